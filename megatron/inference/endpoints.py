"""Request parsing and response shaping of the two endpoints (no HTTP here).

``PUT /api``: Megatron's text generation server format (prompts, tokens_to_generate, logprobs,
temperature, top_k, top_p, add_BOS, random_seed, stop_on_eol, ...); ``POST /completions``: the OpenAI
completions format (prompt, max_tokens, temperature, top_p, logprobs, echo, stop, seed).
For a vision-language model both take images as Megatron's completions endpoint does:
``"multi_modal_data": {"image": [<base64 PNG/JPEG>, ...]}`` (a string for one image), in the order of the
prompts' ``<image>`` tags (see megatron/inference/images.py).
Every problem raises ``BadRequest`` with a one-line reason (HTTP 400).
"""
import time
from typing import List, Optional

from megatron.core.inference import SamplingParams
from megatron.inference.images import (
    ImageConfig,
    assign_images,
    decode_base64,
    detokenize_with_images,
    group_images,
    image_tiles,
    token_strings,
    tokenize_with_images,
)


class BadRequest(ValueError):
    pass


def _field(body, key, kinds, default, what):
    """body[key] when present and of ``kinds`` (bool is never an int here), else ``default``."""
    value = body.get(key)
    if value is None:  # absent or null
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"{key} must be {what}")
    return value


def _stop_words(value) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(w, str) for w in value):
        return [w for w in value if w]
    raise BadRequest("stop must be a string or a list of strings")


def _sampling(body, defaults, temperature_key="temperature"):
    """temperature / top_k / top_p: the request's; the server flags where it sets none of them."""
    number = (int, float)
    if not any(k in body for k in (temperature_key, "top_k", "top_p")):
        return defaults["temperature"], defaults["top_k"], defaults["top_p"]
    temperature = _field(body, temperature_key, number, 1.0, "a number between 0 and 100")
    top_k = _field(body, "top_k", (int,), 0, "an integer between 0 and 1000")
    top_p = _field(body, "top_p", number, 0.0, "a number between 0 and 1")
    if not 0.0 <= temperature <= 100.0:
        raise BadRequest("temperature must be a number between 0 and 100")
    if not 0 <= top_k <= 1000:
        raise BadRequest("top_k must be an integer between 0 and 1000")
    if not 0.0 <= top_p <= 1.0:
        raise BadRequest("top_p must be a number between 0 and 1")
    if top_k > 1 and top_p > 0.0:
        raise BadRequest("cannot set both top_k and top_p")
    return float(temperature), top_k, float(top_p)


def _request_images(body, image_config: Optional[ImageConfig]):
    """The decoded images of ``multi_modal_data`` (tiles of each, in order); [] when there are none."""
    data = body.get("multi_modal_data")
    if data is None:
        return []
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise BadRequest("multi_modal_data must be an object with one key, image")
    encoded = data.get("image") or []
    encoded = [encoded] if isinstance(encoded, str) else encoded
    if not isinstance(encoded, list):
        raise BadRequest("multi_modal_data.image must be a base64 string or a list of them")
    if encoded and image_config is None:
        raise BadRequest("this model takes no images (multi_modal_data); serve a vision-language checkpoint")
    try:
        return [image_tiles(decode_base64(e, f"multi_modal_data.image[{i}]"), image_config,
                            f"multi_modal_data.image[{i}]") for i, e in enumerate(encoded)]
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _text_ids(tokenizer, prompts, images, add_bos, image_config):
    """Token lists of text prompts, and each prompt's images (None without)."""
    if image_config is None:
        return prompts, [tokenize(tokenizer, p, add_bos) for p in prompts], [None] * len(prompts)
    try:
        prompts, per_prompt = assign_images(prompts, images)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    ids = [tokenize_with_images(tokenizer, p, image_config.image_token_index, add_bos) for p in prompts]
    return prompts, ids, per_prompt


def parse_api_request(body, tokenizer, defaults, image_config: Optional[ImageConfig] = None):
    """Megatron's PUT /api body -> (prompt texts, prompt token lists, SamplingParams, images per prompt).
    ``image_config``: the served model's image processing (None: a text model, requests carry no images)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for old, new in (("max_len", "tokens_to_generate"), ("sentences", "prompts")):
        if old in body:
            raise BadRequest(f"{old} is no longer used; replace with {new}")
    for key in ("beam_width", "top_p_decay", "top_p_bound", "prevent_newline_after_colon"):
        if body.get(key) not in (None, False, 0, 0.0):
            raise BadRequest(f"{key} is not supported by this server")
    if "prompts" not in body:
        raise BadRequest("prompts argument required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompts is not a list of strings")
    if not prompts:
        raise BadRequest("prompts is empty")
    if len(prompts) > 128:
        raise BadRequest("Maximum number of prompts is 128")
    tokens_to_generate = _field(body, "tokens_to_generate", (int,), 64, "an integer >= 0")
    if tokens_to_generate < 0:
        raise BadRequest("tokens_to_generate must be an integer >= 0")
    logprobs = _field(body, "logprobs", (bool,), False, "a boolean")
    if tokens_to_generate == 0 and not logprobs:
        raise BadRequest("tokens_to_generate=0 implies logprobs should be True")
    add_bos = _field(body, "add_BOS", (bool,), False, "a boolean")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise BadRequest("Empty prompts require add_BOS=true")
    seed = _field(body, "random_seed", (int,), None, "an integer >= 0")
    if seed is not None and seed < 0:
        raise BadRequest("random_seed must be an integer >= 0")
    stop = _stop_words(body.get("stop"))
    if _field(body, "stop_on_double_eol", (bool,), False, "a boolean"):
        stop.append("\n\n")
    if _field(body, "stop_on_eol", (bool,), False, "a boolean"):
        stop.append("\n")
    _field(body, "no_log", (bool,), False, "a boolean")
    temperature, top_k, top_p = _sampling(body, defaults)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            num_tokens_to_generate=tokens_to_generate, return_log_probs=logprobs,
                            random_seed=seed, stop_words=stop, add_BOS=add_bos)
    prompts, ids, images = _text_ids(tokenizer, prompts, _request_images(body, image_config), add_bos, image_config)
    return prompts, ids, params, images


def tokenize(tokenizer, text: str, add_bos: bool) -> List[int]:
    ids = [int(t) for t in tokenizer.tokenize(text)] if text else []
    return [tokenizer.bos] + ids if add_bos else ids


def api_response(prompts, requests, tokenizer, logprobs: bool, image_token_index: Optional[int] = None) -> dict:
    """Megatron's /api answer: prompt + generation text, the tokens, their strings, their log-probs
    (an image is its one image token, with the string ``<image>``)."""
    out = {"text": [], "segments": [], "tokens": []}
    if logprobs:
        out["logprobs"] = []
    for prompt, req in zip(prompts, requests):
        tokens = req.given_prompt_tokens + req.generated_tokens
        out["text"].append(prompt + (req.generated_text or ""))
        out["tokens"].append(tokens)
        out["segments"].append(token_strings(tokenizer, tokens, image_token_index))
        if logprobs:
            out["logprobs"].append(req.prompt_log_probs + req.generated_log_probs)
    return out


def parse_completions_request(body, tokenizer, defaults, image_config: Optional[ImageConfig] = None):
    """OpenAI completions body -> (prompt texts, token lists, SamplingParams, echo, logprobs, images per
    prompt). Token-list prompts mark each image with the image token id itself."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "prompt" not in body:
        raise BadRequest("prompt argument required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompt = [prompt]
    is_list = isinstance(prompt, list) and len(prompt) > 0
    images = _request_images(body, image_config)
    image_token = None if image_config is None else image_config.image_token_index
    if is_list and all(isinstance(p, str) for p in prompt):
        texts, ids, per_prompt = _text_ids(tokenizer, prompt, images, False, image_config)
    else:
        if is_list and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [prompt]
        elif is_list and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            ids = prompt
        else:
            raise BadRequest("prompt must be a string, a list of strings, a token list or a list of token lists")
        per_prompt = [None] * len(ids)
        if image_config is not None:
            try:
                per_prompt = group_images([p.count(image_token) for p in ids], images, "image tokens")
            except ValueError as e:
                raise BadRequest(str(e)) from None
        texts = [detokenize_with_images(tokenizer, p, image_token) if image_token is not None
                 else tokenizer.detokenize(p) for p in ids]
    if any(not 0 <= t < tokenizer.vocab_size and t != image_token for p in ids for t in p):
        raise BadRequest(f"prompt token ids must be in [0, {tokenizer.vocab_size})")
    if len(texts) > 128:
        raise BadRequest("Maximum number of prompts is 128")
    max_tokens = _field(body, "max_tokens", (int,), 16, "an integer >= 0")
    if max_tokens < 0:
        raise BadRequest("max_tokens must be an integer >= 0")
    echo = _field(body, "echo", (bool,), False, "a boolean")
    logprobs = _field(body, "logprobs", (int,), None, "an integer >= 0 or null")
    if logprobs is not None and logprobs < 0:
        raise BadRequest("logprobs must be an integer >= 0 or null")
    if max_tokens == 0 and not echo:
        raise BadRequest("max_tokens=0 needs echo=true (it returns only the prompt)")
    for key in ("n", "best_of"):
        if _field(body, key, (int,), 1, "1") != 1:
            raise BadRequest(f"{key} > 1 is not supported")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported; send stream=false")
    seed = _field(body, "seed", (int,), None, "an integer >= 0")
    if seed is not None and seed < 0:
        raise BadRequest("seed must be an integer >= 0")
    temperature, top_k, top_p = _sampling(body, defaults)
    if "top_p" in body and top_p >= 1.0:
        top_p = 0.0  # OpenAI's 1.0 keeps every token: our "off"
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, num_tokens_to_generate=max_tokens,
                            return_log_probs=logprobs is not None or max_tokens == 0, random_seed=seed,
                            stop_words=_stop_words(body.get("stop")))
    return texts, ids, params, echo, logprobs is not None, per_prompt


def completions_response(texts, requests, tokenizer, echo: bool, logprobs: bool, model: str,
                         image_token_index: Optional[int] = None) -> dict:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, (text, req) in enumerate(zip(texts, requests)):
        prompt_tokens += len(req.prompt_tokens)  # the model's positions, images included
        completion_tokens += len(req.generated_tokens)
        choice = {"index": i, "text": (text if echo else "") + (req.generated_text or ""),
                  "finish_reason": req.finish_reason, "logprobs": None}
        if logprobs:
            ids = (req.given_prompt_tokens if echo else []) + req.generated_tokens
            lps = ([None] + req.prompt_log_probs if echo else []) + req.generated_log_probs
            strings = token_strings(tokenizer, ids, image_token_index)
            offsets, pos = [], 0
            for s in strings:
                offsets.append(pos)
                pos += len(s)
            choice["logprobs"] = {"tokens": strings, "token_logprobs": lps, "top_logprobs": None,
                                  "text_offset": offsets}
        choices.append(choice)
    return {"id": f"cmpl-{requests[0].request_id}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
