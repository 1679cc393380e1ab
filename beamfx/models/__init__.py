"""Plain models: they read like the math and call Beam IR ops; they pick no kernel."""
