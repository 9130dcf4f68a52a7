"""The commands that drive the harness (the simulator, the live demo, the real
vLLM engine, the bug zoo), apart from the replay front ends beside them."""
