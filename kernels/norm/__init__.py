"""RMSNorm and the small elementwise ops of the plain model."""
