"""Model architectures (one file each) and the registry that maps a Hugging Face config to one."""
