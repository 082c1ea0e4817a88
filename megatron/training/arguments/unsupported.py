"""What to do instead, for Megatron flags users commonly pass that this project does not implement yet.

megatron_flags.py registers every Megatron flag our parser lacks, with Megatron's type and default, and
refuses it at a non-default value with one line ("--fp4-format is not supported yet: <hint>"); the hint
comes from here. A module that implements one of these flags deletes its line.
"""

# flag -> (argparse kwargs of an earlier registration, kept for reference; what to do instead)
UNSUPPORTED_FLAGS = {
    "--fp4-format": (dict(type=str), "FP4 is not supported"),
    "--heterogeneous-layers-config-path": (dict(type=str), "heterogeneous layers are not supported"),
    "--pytorch-profiler-collect-chakra": (dict(action="store_true"),
                                          "Chakra execution traces are not written; --use-pytorch-profiler "
                                          "writes a Chrome trace per rank"),
    "--cuda-graph-modules": (dict(nargs="+"), "per-layer CUDA graphs are not built for training (use "
                                              "--cuda-graph-impl full_iteration); the generation tools take it "
                                              "as a request for their decode-step graph"),
    "--tokenizer-hf-no-use-fast": (dict(action="store_true"), "HuggingFaceTokenizer reads tokenizer.json with the "
                                                              "fast tokenizers library; there is no slow Python "
                                                              "tokenizer here: drop the flag"),
    "--ckpt-fully-parallel-load-process-group": (dict(type=str), "the fully parallel load spreads reads over "
                                                                 "the DP group (dp); ep_dp is not built"),
    "--ckpt-fully-parallel-save-process-group": (dict(type=str), "the fully parallel save spreads writes over "
                                                                 "the DP group (dp); ep_dp is not built"),
}

