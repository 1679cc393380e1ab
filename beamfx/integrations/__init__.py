"""Front ends that bring beamfx's passes to serving engines (vLLM: `beamfx.integrations.vllm`)."""
