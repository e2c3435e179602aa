"""Run a DeepSeek model with its routed experts on the CPU through hmoe (no network needed).

Builds a random DeepSeek model with transformers (small DeepSeek-V3 by default; --preset v2-lite has
DeepSeek-V2-Lite's real dimensions, about 31 GB in bf16), generates tokens with the original model,
patches it with hmoe.nn.patch_model, generates again, and prints the time per token of both. On a GPU
the original keeps everything on the GPU, and the patched model decodes with CUDA graphs
(hmoe.nn.GraphDecoder); on the CPU both run eagerly.

    python examples/deepseek_hybrid.py [--preset small|v2-lite|tiny] [--tokens 32] [--cpu] [--gpu-experts N]
                                       [--seed 0]

--gpu-experts N keeps each MoE layer's N busiest experts (by the routing of the prompt) where the hidden
states are, the others on the CPU (hmoe.nn.patch_model's gpu_experts and calibration). --seed picks the
random model (the same seed, the same model): on a few models in a hundred the two models' bf16 rounding
puts a token's router scores on either side of a near-tie, the token then takes another expert, and the
logits differ by more than rounding.
"""
import argparse
import sys
import time

import torch

import hmoe.nn as hn
from hmoe.bench import models


def per_token(decode, prompt, tokens):
    decode(prompt, 2)  # warm-up (and CUDA graph capture)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = decode(prompt, tokens)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=sorted(models.PRESETS))
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--cpu", action="store_true", help="keep everything on the CPU even if a GPU is present")
    p.add_argument("--gpu-experts", type=int, default=0,
                   help="experts per MoE layer kept with the hidden states, the busiest on the prompt (default 0)")
    p.add_argument("--seed", type=int, default=0, help="the random model's seed (default 0)")
    opts = p.parse_args()
    if opts.tokens < 1:
        p.error("--tokens must be at least 1")
    if opts.gpu_experts < 0:
        p.error("--gpu-experts must be at least 0")
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.cpu else "cpu")
    dtype = torch.bfloat16
    print(f"building a random {opts.preset} model (seed {opts.seed}, {dtype}, on {device}, routed experts in host "
          "memory)")
    torch.manual_seed(opts.seed)
    model = models.build(opts.preset, dtype=dtype, device=device)
    cfg = model.config
    if opts.gpu_experts >= cfg.n_routed_experts:
        print(f"--gpu-experts {opts.gpu_experts}: the model has {cfg.n_routed_experts} routed experts a layer; "
              "leave at least one on the CPU", file=sys.stderr)
        return 2
    prompt = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)

    kw = dict(do_sample=False, pad_token_id=0)
    original = None
    if device.type == "cuda" and opts.preset != "v2-lite":  # v2-lite's experts do not fit a GPU in every case
        moved = model.to(device)
        with torch.no_grad():
            original, t_orig = per_token(
                lambda ids, n: moved.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw), prompt, opts.tokens)
        print(f"original (all on {device}):  {t_orig * 1e3:8.2f} ms/token")
    elif device.type == "cpu":
        with torch.no_grad():
            original, t_orig = per_token(
                lambda ids, n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw), prompt, opts.tokens)
        print(f"original (all on the CPU):  {t_orig * 1e3:8.2f} ms/token")

    ref_logits = None
    if original is not None:  # the next-token logits after the prompt, before and after patching
        with torch.no_grad():
            ref_logits = model(prompt).logits[0, -1].double()
    placement = dict(gpu_experts=opts.gpu_experts, calibration=prompt) if opts.gpu_experts else {}
    report = hn.patch_model(model, **placement)  # progress bar on stderr
    print(report)
    if ref_logits is not None:
        with torch.no_grad():
            got = model(prompt).logits[0, -1].double()
        rel = ((got - ref_logits).norm() / ref_logits.norm()).item()
        print(f"next-token logits after the prompt, patched against the original: {rel:.2e} relative "
              f"(bf16's unit roundoff: {2.0 ** -8:.2e})")

    attention = []

    def hybrid(ids, n):
        dec = hn.GraphDecoder(model, batch_size=1, max_cache_len=ids.shape[1] + n + 1, capture=device.type == "cuda")
        attention.append(dec.attention_reason)
        return dec.generate(ids, n)

    patched, t_hyb = per_token(hybrid, prompt, opts.tokens)
    how = "CUDA graphs" if device.type == "cuda" else "eager"
    if opts.gpu_experts:
        how += f", {opts.gpu_experts} experts a layer on {device}"
    print(f"patched (experts on the CPU, {how}): {t_hyb * 1e3:8.2f} ms/token; decode attention: {attention[-1]}")
    if original is not None:
        same = int((patched[0, : original.shape[1]] == original[0]).sum()) - prompt.shape[1]
        print(f"greedy tokens equal to the original's: {same} of {opts.tokens} (bf16: the two round differently)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
