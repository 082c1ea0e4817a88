"""Storage strategies behind `dist_checkpointing.save/load` (torch.distributed.checkpoint)."""
