"""Generation with images on the tiny LLaVA: greedy tokens from the KV-cache engine equal greedy decoding by
full recomputation with the training forward (one image token per image, expanded inside the model), and
the server's scheduling loop under TP=2 (rank 0 broadcasts prompts with their image tiles, rank 1 follows)
answers as TP=1. fp32; layouts differ by ~1e-7, far from the random model's top-two logit gaps."""
import threading

import torch

from tests.fixtures.tiny_vlm import IMAGE_TOKEN, IMG, language_config, tiny_llava
from tests.parallel.dist_utils import run_distributed

NEW = 6
PROMPTS = [[3, IMAGE_TOKEN, 7, 9], [IMAGE_TOKEN, 5, IMAGE_TOKEN, 2, 8], [4, 6, 1]]
N_IMAGES = [1, 2, 0]


def _images():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, 3, IMG, IMG, generator=g) if n else None for n in N_IMAGES]


def _model(tp):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(5)
    return tiny_llava(language_config(tensor_model_parallel_size=tp), max_seq=64).eval()


def _recompute(model, prompt, images):
    """Greedy tokens by the training forward over the whole sequence at every step."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            logits, _ = model(images, torch.tensor([seq]), None, None)
            seq.append(int(gather_from_tensor_model_parallel_region(logits)[0, -1].argmax()))
    return seq[len(prompt):]


def _world(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.inference import InferenceEngine, SamplingParams
    from megatron.inference.images import PromptImages
    from megatron.inference.scheduler import GenerationScheduler, follow

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model, images = _model(tp), _images()
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    out = {"engine": [r.generated_tokens for r in InferenceEngine(model, max_batch_size=4, max_sequence_length=64)
                      .generate(PROMPTS, params, images=images)]}
    if tp == 1:
        out["recompute"] = [_recompute(model, p, im) for p, im in zip(PROMPTS, images)]
        return out
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=64)
    if torch.distributed.get_rank() != 0:
        follow(engine)
        return out
    scheduler, tickets = GenerationScheduler(engine), []

    def clients():
        for p, im in zip(PROMPTS, images):
            tiles = None if im is None else PromptImages(im, [1] * im.shape[0])
            tickets.append(scheduler.submit(p, params, tiles))
        for t in tickets:
            t.done.wait()
        scheduler.stop()
    thread = threading.Thread(target=clients)
    thread.start()
    scheduler.run()
    thread.join()
    out["served"] = [t.request.generated_tokens for t in tickets]
    return out


def test_engine_equals_recompute_and_tp2_serving_equals_tp1():
    (tp1,) = run_distributed(_world, 1, 1)
    assert tp1["engine"] == tp1["recompute"]
    tp2 = run_distributed(_world, 2, 2)
    assert tp2[0]["engine"] == tp2[1]["engine"] == tp1["engine"]
    assert tp2[0]["served"] == tp1["engine"]
