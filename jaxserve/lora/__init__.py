"""LoRA adapters: reading PEFT adapters (peft.py) and the LoRA slots an engine serves them from (manager.py)."""
