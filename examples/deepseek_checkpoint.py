"""Generate text from a DeepSeek-V2/V3 checkpoint with hmoe: routed experts on the CPU, the rest on the GPU.

hmoe.nn.load_model reads the checkpoint (its routed experts one expert at a time into CPU experts,
quantised as they are read with --quant; fp8 checkpoints such as DeepSeek-V3's are dequantised), then
hmoe.nn.GraphDecoder decodes every prompt of the batch, padded to one length, with each decode step
replayed from a CUDA graph (on the CPU, --cpu, eagerly). Decoding is greedy and a row ends at the
tokenizer's end-of-sequence token. --gpu-experts N keeps each layer's N busiest experts on the prompts on
the GPU (read again from the checkpoint in bf16). The checkpoint directory needs its config.json,
safetensors shards and tokenizer files, as published.

    python examples/deepseek_checkpoint.py PATH [--prompt TEXT ...] [--max-new-tokens 64]
        [--quant none|int8|int4|fp8] [--gpu-experts N] [--chat] [--cpu]
"""
import argparse
import sys
import time

import torch

import hmoe.nn as hn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: one prompt)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quant", default="none", choices=["none", "int8", "int4", "fp8"],
                   help="the CPU experts' weight format (default none: the checkpoint's float dtype, bf16 for fp8)")
    p.add_argument("--gpu-experts", type=int, default=0, metavar="N",
                   help="keep each layer's N busiest experts on the prompts on the GPU (default 0: all on the CPU)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--cpu", action="store_true", help="keep everything on the CPU even if a GPU is present")
    opts = p.parse_args()
    if opts.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(opts.path)
    except (OSError, ValueError) as e:
        print(f"no tokenizer in {opts.path}: {e}", file=sys.stderr)
        return 2
    prompts = opts.prompt or ["The capital of France is"]
    if opts.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                   for t in prompts]
    if opts.gpu_experts < 0:
        p.error("--gpu-experts must be at least 0")
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.cpu else "cpu")
    tok.padding_side = "left"  # a batch's prompts end together; GraphDecoder takes either side
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    t0 = time.perf_counter()
    try:
        model = hn.load_model(opts.path, device=device, quant=None if opts.quant == "none" else opts.quant,
                              gpu_experts=opts.gpu_experts or None,
                              calibration={"input_ids": ids, "attention_mask": mask} if opts.gpu_experts else None)
    except MemoryError as e:  # counted before anything is read: the sizes, and the formats that take less
        print(e, file=sys.stderr)
        return 2
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    dec = hn.GraphDecoder(model, batch_size=len(prompts), max_cache_len=ids.shape[1] + opts.max_new_tokens + 1,
                          capture=device.type == "cuda")
    t0 = time.perf_counter()
    out = dec.generate(ids, opts.max_new_tokens, attention_mask=mask, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    new = out[:, ids.shape[1]:].cpu()
    for text, row in zip(prompts, new):
        print(f"--- {text!r}\n{tok.decode(row, skip_special_tokens=True)}")
    steps = new.shape[1]
    print(f"{steps} decode steps of {len(prompts)} sequences in {dt:.2f} s ({steps / dt:.2f} steps/s, prefill "
          f"included; {'CUDA graphs' if device.type == 'cuda' else 'eager'}); decode attention: {dec.attention}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
