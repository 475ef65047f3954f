"""Model checkpoints: a hub id resolved to a local folder (hub.py); LoRA adapters under PEFT's
names and their merge (lora_merge.py), and as PEFT adapter folders (peft_adapter.py)."""
