"""Generation with images: a tiny random Hugging Face LLaVA (CLIP ViT + Llama, fp32, CPU), imported with
import_hf_checkpoint, generates through our engine exactly the tokens of transformers'
``LlavaForConditionalGeneration.generate(do_sample=False)``: one image, two images, and a text-only prompt
batched together, at TP=1 (eager and bucketed decode steps) and TP=2; prompt log-probs equal HF's at the
text positions. The same checkpoint through tools/generate.py --image and the REST server (base64 images
in ``multi_modal_data``) gives the same tokens.

Greedy choices can differ only on a near-tie of the top two logits; the random model's gaps (~1e-2) are far
above the ~1e-6 difference of the two fp32 forwards.
"""
import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from tests.fixtures.hf_checks import randomize_vectors
from tests.parallel.dist_utils import free_port, run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
VOCAB, IMAGE_TOKEN, EOS, IMG, PATCH, NEW = 128, 100, 127, 8, 4, 8
PATCHES = (IMG // PATCH) ** 2  # features per image ("default" strategy: the class token is dropped)
# (prompt with one image token per image, its image files)
PROMPTS = [([5, IMAGE_TOKEN, 17, 42], ["a.png"]), ([IMAGE_TOKEN, 9, 11, IMAGE_TOKEN, 13, 3], ["b.png", "c.png"]),
           ([7, 8, 9], [])]


def _hf_config():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    vision = CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMG, patch_size=PATCH, projection_dim=16)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, initializer_range=0.2)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                       vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=PATCHES)


def _tiles(path):
    from megatron.training.datasets.image_processing import process_image
    with Image.open(path) as image:
        return process_image(image, IMG, IMG, "clip")  # [1, 3, IMG, IMG]


def _expand(ids):
    return [t for x in ids for t in ([x] * PATCHES if x == IMAGE_TOKEN else [x])]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    from megatron.training.checkpointing.hf import import_hf_checkpoint
    root = tmp_path_factory.mktemp("llava_gen")
    g = torch.Generator().manual_seed(1)
    for name, (w, h) in zip(("a.png", "b.png", "c.png"), ((12, 10), (8, 8), (16, 9))):
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / name)
    torch.manual_seed(0)
    hf = LlavaForConditionalGeneration(_hf_config()).eval()
    randomize_vectors(hf)  # random norms and biases, so a swapped or dropped tensor shows in the tokens
    hf.save_pretrained(str(root / "hf"))
    import_hf_checkpoint(str(root / "hf"), str(root / "ckpt"))
    images = [torch.cat([_tiles(root / f) for f in files]) if files else None for _, files in PROMPTS]
    expected, logits = [], []
    with torch.no_grad():
        for (ids, _), pixels in zip(PROMPTS, images):
            hf_ids = torch.tensor([_expand(ids)])
            extra = {} if pixels is None else {"pixel_values": pixels}
            out = hf.generate(input_ids=hf_ids, attention_mask=torch.ones_like(hf_ids), max_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, **extra)
            expected.append(out[0, hf_ids.shape[1]:].tolist())
            logits.append(hf(input_ids=hf_ids, **extra).logits[0])
    assert all(len(set(e)) > 2 for e in expected)  # real continuations, not an immediate stop
    return dict(root=root, ckpt=str(root / "ckpt"), images=images, expected=expected, hf_logits=logits)


def engine_tokens(ckpt, images, layouts):
    """Per (tp, use_cuda_graphs): each prompt's greedy tokens, and prompt 0's prompt log-probs."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference import InferenceEngine, SamplingParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.arguments.vision_args import add_vlm_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.checkpointing.args import load_args_from_checkpoint
    from megatron.training.global_vars import destroy_global_vars, set_args
    from megatron.training.model_setup import get_model
    from pretrain_vlm import model_provider

    out = []
    for tp, graphs in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1)
        args = parse_args(add_vlm_args, argv=["--load", ckpt, "--use-checkpoint-args", "--micro-batch-size", "1",
                                              "--tensor-model-parallel-size", str(tp), "--lr", "0",
                                              "--train-iters", "1", "--mock-data", "--exit-on-missing-checkpoint"])
        args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        load_args_from_checkpoint(args)
        set_args(validate_args(args))
        model = get_model(model_provider, wrap_with_ddp=False)
        load_checkpoint(model, None, None)
        engine = InferenceEngine(model[0], max_batch_size=4, max_sequence_length=64, vocab_size=VOCAB,
                                 termination_id=EOS, use_cuda_graphs=graphs)
        reqs = engine.generate([p for p, _ in PROMPTS], SamplingParams(top_k=1, num_tokens_to_generate=NEW),
                               images=images)
        logprobs = engine.generate([PROMPTS[0][0]], SamplingParams(top_k=1, num_tokens_to_generate=1,
                                                                     return_log_probs=True), images=images[:1])
        out.append(([r.generated_tokens for r in reqs], logprobs[0].prompt_log_probs))
        destroy_global_vars()
        ps.destroy_model_parallel()
    return out


def test_engine_greedy_equals_transformers(world):
    ranks = run_distributed(engine_tokens, 2, world["ckpt"], world["images"], [(1, False), (1, True), (2, False)],
                            timeout=600)
    for tokens, prompt_lps in ranks[0]:
        assert tokens == world["expected"]
        # Prompt 0 = [5, <image>, 17, 42]: the image token has none; 17 and 42 are predicted at expanded
        # positions PATCHES and PATCHES + 1.
        lps = torch.log_softmax(world["hf_logits"][0].float(), -1)
        assert prompt_lps[0] is None
        ref = [lps[PATCHES, 17].item(), lps[PATCHES + 1, 42].item()]
        assert prompt_lps[1:] == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_generate_tool_with_images(world):
    root = world["root"]
    cmd = [sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", world["ckpt"],
           "--use-checkpoint-args", "--num-tokens-to-generate", str(NEW),
           "--prompt", "5 <image> 17 42", "--prompt", "<image> 9 11 <image> 13 3", "--prompt", "7 8 9"]
    for f in ("a.png", "b.png", "c.png"):
        cmd += ["--image", str(root / f)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ids = re.findall(r"^--- \d+ tokens \(\w+\).*, ids (\[[\d, ]*\])$", p.stdout, re.M)
    assert [json.loads(i) for i in ids] == world["expected"]
    bad = subprocess.run(cmd[:-4] + ["--image", str(root / "missing.png")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=ENV)
    assert bad.returncode != 0 and "missing.png cannot be read as an image" in bad.stderr


def _call(url, path, body, method="PUT"):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _b64(path):
    return base64.b64encode(open(path, "rb").read()).decode()


def test_rest_server_with_images(world):
    root, port = world["root"], free_port()
    log_path = root / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "run_text_generation_server.py"),
                                 "--load", world["ckpt"], "--use-checkpoint-args", "--port", str(port)],
                                cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(480):
            assert proc.poll() is None, open(log_path).read()[-3000:]
            try:
                urllib.request.urlopen(url, timeout=1).read()
                break
            except OSError:
                time.sleep(0.25)
        status, out = _call(url, "/api", {"prompts": ["5 <image> 17 42"], "tokens_to_generate": NEW,
                                          "multi_modal_data": {"image": [_b64(root / "a.png")]}})
        assert status == 200, out
        assert out["tokens"][0] == PROMPTS[0][0] + world["expected"][0]
        assert out["segments"][0][1] == "<image>"
        # OpenAI completions with a token-list prompt: the image token marks each image; a data URL works too.
        images = [_b64(root / "b.png"), "data:image/png;base64," + _b64(root / "c.png")]
        status, out = _call(url, "/completions", {"prompt": PROMPTS[1][0], "max_tokens": NEW, "temperature": 0.0,
                                                  "multi_modal_data": {"image": images}}, method="POST")
        assert status == 200, out
        assert out["choices"][0]["text"] == " ".join(map(str, world["expected"][1][:-1] if world["expected"][1][-1]
                                                         == EOS else world["expected"][1]))
        bad = [({"prompts": ["5 <image> 17"], "multi_modal_data": {"image": []}}, "1 <image> tag(s) for 0 image"),
               ({"prompts": ["5 17"], "multi_modal_data": {"image": ["not base64!"]}}, "is not valid base64"),
               ({"prompts": ["5"], "multi_modal_data": {"image": [base64.b64encode(b"abc").decode()]}},
                "multi_modal_data.image[0] cannot be read as an image")]
        for body, message in bad:
            status, out = _call(url, "/api", body)
            assert status == 400 and message in out["message"], out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_text_model_refuses_images():
    from megatron.inference.endpoints import BadRequest, parse_api_request
    with pytest.raises(BadRequest, match="this model takes no images"):
        parse_api_request({"prompts": ["x"], "multi_modal_data": {"image": ["aGk="]}}, None,
                          {"temperature": 1.0, "top_k": 1, "top_p": 0.0})

