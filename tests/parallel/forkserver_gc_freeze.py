"""Imported last by run_distributed's forkserver (dist_utils._PRELOAD): the preloaded modules' objects go into the
permanent generation, so a forked rank's collections (pretrain's one before its loop, the automatic ones) walk only
what the rank made instead of every object of torch and megatron, and do not write to (and so copy) every page of
the server's heap: a 2-rank tiny pretrain() costs each rank ~0.45 s of CPU instead of ~0.7 s."""
import gc

gc.freeze()
