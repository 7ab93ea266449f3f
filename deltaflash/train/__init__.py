"""Training of the bundled demo pair: a small Qwen3.5 target and its DFlash drafter, on the stdlib."""
