"""Flags for process layout, data sources and tokenizers."""


def add_distributed_args(parser):
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel degree.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel degree.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per virtual pipeline stage (interleaved schedule).")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Virtual pipeline stages per pipeline rank.")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="The interleaved schedule runs micro-batches through each virtual stage in groups of this "
                        "many (default: the pipeline size; larger: a longer warm-up, fewer stage switches); the "
                        "micro-batch count must be a multiple of it.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Layers on the first pipeline stage (uneven split); the rest split evenly.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Layers on the last pipeline stage (uneven split); the rest split evenly.")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as one layer slot of the first pipeline stage.")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the output layer and loss as one layer slot of the last pipeline stage.")
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="Each pipeline (virtual) stage's layers, '|' between stages in interleaved order: E "
                        "embedding, t transformer layer, m MTP layer, L loss; x*n and (...)*n repeat, e.g. "
                        "'Et*9|t*9|t*9|t*5L'. PP x VP entries set the virtual stages per rank.")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="Interleaved schedule: wait for each pipeline send/recv batch at once (no overlap).")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true",
                   dest="overlap_p2p_comm_warmup_flush",
                   help="Interleaved schedule: overlap pipeline send/recv in warm-up and flush too, not only "
                        "in steady 1F1B.")
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true",
                   help="The last pipeline stage parks its output layer's weight-gradient GEMMs and runs them "
                        "after its last backward, while the earlier stages finish theirs: each of its backwards "
                        "sends the input gradient upstream one GEMM sooner (needs --pipeline-model-parallel-size "
                        "> 1; the parked inputs cost [s, b, h] of memory per micro-batch).")
    g.add_argument("--wgrad-deferral-limit", type=int, default=0,
                   help="With --defer-embedding-wgrad-compute: park only the first N output-layer GEMMs of a step "
                        "(the rest run in their backward), bounding the parked memory; 0: all.")
    g.add_argument("--sequence-parallel", action="store_true", help="Sequence parallelism (needs TP > 1).")
    g.add_argument("--context-parallel-size", type=int, default=1, help="Context-parallel degree.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="Expert-parallel degree.")
    g.add_argument("--disable-gloo-process-groups", action="store_false", dest="use_gloo_process_groups",
                   help="Create no gloo twins of the data-parallel groups (the parallel_state *_gloo getters then "
                        "return None); nothing here needs them, they only cost start-up time and host memory.")
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"],
                   help="Process-group backend (gloo is used automatically without CUDA).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Collective timeout.")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="Set by old launchers; LOCAL_RANK from the environment wins.")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true", help="Rank order tp-cp-ep-pp-dp.")
    g.add_argument("--nccl-communicator-config-path", type=str, default=None,
                   help="YAML of group name -> NCCL communicator options (is_high_priority_stream, "
                        "cga_cluster_size, max_ctas, min_ctas, net_name), e.g. 'tp: {max_ctas: 16}'.")
    g.add_argument("--high-priority-stream-groups", nargs="+", type=str, default=[],
                   help="Groups whose NCCL stream gets high priority (e.g. tp ep dp_cp), so overlapped "
                        "communication kernels take SMs ahead of queued compute.")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="Shard params, grads and optimizer state over DP with torch FSDP2 (composes with TP).")
    return parser


def add_data_args(parser):
    g = parser.add_argument_group(title="data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Blend: 'prefix ...' or 'weight prefix weight prefix ...'.")
    g.add_argument("--split", type=str, default=None, help="Train,valid,test proportions, e.g. 969,30,1.")
    g.add_argument("--train-data-path", nargs="*", default=None, help="Training blend.")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="Validation blend.")
    g.add_argument("--test-data-path", nargs="*", default=None, help="Test blend.")
    g.add_argument("--data-args-path", type=str, default=None, help="File holding the --data-path value.")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help="JSON file with train/valid/test blends.")
    g.add_argument("--mock-data", action="store_true",
                   help="Synthetic data, no files needed (GPT documents; BERT and T5 sentence-split text).")
    g.add_argument("--data-cache-path", type=str, default=None, help="Where dataset index caches go.")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="Read .bin files without mmap.")
    g.add_argument("--seq-length", type=int, default=None, help="Training sequence length.")
    g.add_argument("--encoder-seq-length", type=int, default=None, help="Alias of --seq-length.")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    g.add_argument("--dataloader-type", type=str, default=None, choices=["single", "cyclic", "external"],
                   help="single: ordered and resumable; cyclic: reshuffled per epoch.")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after EOD.")
    g.add_argument("--reset-attention-mask", action="store_true", help="No attention across EOD.")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader", help="Do not build the causal mask in the loader.")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1, help="Dataset build threads.")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="Extra samples requested from each blended component.")
    return parser


_TOKENIZER_TYPES = ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                    "MultimodalTokenizer", "NullTokenizer", "SFTTokenizer"]


def add_tokenizer_args(parser):
    g = parser.add_argument_group(title="tokenizer")
    g.add_argument("--tokenizer-type", type=str, default=None, choices=_TOKENIZER_TYPES, help="Tokenizer.")
    g.add_argument("--vocab-file", type=str, default=None, help="Vocabulary file.")
    g.add_argument("--merge-file", type=str, default=None, help="BPE merge file.")
    g.add_argument("--tokenizer-model", type=str, default=None, help="SentencePiece/HF/TikToken model.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size (NullTokenizer, TikToken).")
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                   help="NullTokenizer's end-of-document id (default --vocab-size - 1).")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                   help="NullTokenizer's padding id (default -1: none).")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="Extra sentinel tokens (T5).")
    g.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"], help="TikToken pattern.")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikToken special tokens.")
    g.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None, help="TikToken specials.")
    return parser
