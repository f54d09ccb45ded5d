"""LoRA adapters: reading PEFT adapters (peft.py) and the slots an engine serves them from (manager.py)."""
