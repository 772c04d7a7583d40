"""Model families (one file each, registered in registry.py), the layers and MoE layer they share,
config and checkpoint readers."""
