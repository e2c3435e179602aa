# `python -m hmoe.bench e2e`: a whole DeepSeek model patched with hmoe.nn (routed experts on the CPU)
# against transformers with the routed experts offloaded the way its users do it, and against the
# memory-bandwidth bound of the routed experts.
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from hmoe.bench._report import int_range, output_file, positive_int, progress
from hmoe.bench.models import PRESETS

# models.py builds the models with transformers (a version with DeepSeek-V2/V3): hmoe does not
# require it, pyproject's test extra has it.
NEEDS_TRANSFORMERS = "pip install 'transformers>=4.48'"


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=(
        "Decode tokens/s (batch sizes of --batches, CUDA graphs and eager) and prefill tokens/s (--prefill tokens, "
        "batch 1) of a random DeepSeek model whose routed experts run on the CPU through hmoe.nn.patch_model, "
        "against transformers with the routed experts offloaded to the CPU (accelerate's dispatch_model with "
        "those modules on 'cpu': weights copied to the GPU at each forward) and against the bound: active routed "
        "expert bytes per step over the host's measured read bandwidth. --cpu-only runs everything on the CPU "
        "and compares with transformers on the CPU."))
    p.add_argument("--preset", default="v2-lite", choices=tuple(PRESETS),
                   help="model dimensions: v2-lite (default), small, tiny")
    p.add_argument("--layers", type=positive_int, default=None, help="MoE layers (default: the preset's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--batches", default="1,8", help="decode batch sizes (default 1,8)")
    p.add_argument("--prefill", type=int_range(0), default=512, help="prefill tokens, batch 1 (default 512; 0: skip)")
    p.add_argument("--steps", type=positive_int, default=8,
                   help="timed decode steps per round, each row and batch size (default 8)")
    p.add_argument("--rounds", type=positive_int, default=4,
                   help="rounds per row: a block of --steps decode steps, then as many of the CPU experts alone "
                        "(default 4)")
    p.add_argument("--prompt", type=positive_int, default=16,
                   help="prompt tokens before the timed decode steps, the context they attend to (default 16)")
    p.add_argument("--baseline-steps", type=positive_int, default=3, help="timed decode steps of the baseline (default 3)")
    p.add_argument("--no-baseline", action="store_true", help="leave transformers out")
    p.add_argument("--cpu-only", action="store_true", help="everything on the CPU (default: on the GPU if any)")
    p.add_argument("--handovers", default="doorbell,host_func",
                   help="hand-overs of the CPU experts timed in CUDA-graph steps, first = the one the goals use "
                        "(HMOE_CPU_HANDOVER; default doorbell,host_func)")
    p.add_argument("--json", metavar="PATH", type=output_file, help="also write every number to PATH as JSON")
    opts = p.parse_args(argv)
    try:
        opts.batches = [int(b) for b in opts.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {opts.batches!r}")
    if not opts.batches or min(opts.batches) < 1:
        p.error("--batches must be positive")
    from hmoe.nn._staging import HANDOVERS

    opts.handovers = [h for h in opts.handovers.split(",") if h]
    if not opts.handovers or any(h not in HANDOVERS for h in opts.handovers):
        p.error(f"--handovers must list some of {', '.join(HANDOVERS)}")
    return opts


@contextlib.contextmanager
def handover(name: str):
    """HMOE_CPU_HANDOVER = name inside the block (hmoe/nn/_staging.py reads it at each launch)."""
    old = os.environ.get("HMOE_CPU_HANDOVER")
    os.environ["HMOE_CPU_HANDOVER"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["HMOE_CPU_HANDOVER"]
        else:
            os.environ["HMOE_CPU_HANDOVER"] = old


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MODEL_ATTENTION = "graph, tf attention"  # the row whose decode steps run transformers' attention


def _host_run_seconds(model) -> float:
    """Seconds of CPU expert runs handed over on a CUDA stream since the last call, over every HybridMoE."""
    import hmoe.nn as hn

    return 1e-6 * sum(sum(b.host_run_times()) for b in model.modules() if isinstance(b, hn.HybridMoE))


class DecodeRun:
    """Decode steps of `batch` sequences after a prefill of prompt_len tokens (hmoe.nn.GraphDecoder:
    static cache, room for `steps` more; with capture, steps replay one CUDA graph; `attention` as
    GraphDecoder's), timed in blocks: block(n) -> (seconds per step, seconds of it the CPU experts ran
    inside host jobs). The host waits for the steps through GraphDecoder.synchronize (asleep: a
    spinning wait takes a core from the CPU experts). `reason` is GraphDecoder.attention_reason."""

    def __init__(self, torch, model, batch: int, steps: int, capture: bool, device, vocab: int,
                 attention: str = "auto", prompt_len: int = 16):
        import hmoe.nn as hn

        self.model = model
        self.dec = hn.GraphDecoder(model, batch_size=batch, max_cache_len=prompt_len + steps + 4,
                                   capture=capture, attention=attention)
        g = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(device)
        self.nxt = self.dec.prefill(prompt).argmax(-1)
        self.block(2)  # eager warm-up, then the capture (and its first replay)
        self.reason = self.dec.attention_reason

    def block(self, steps: int) -> tuple[float, float]:
        self.dec.synchronize()
        _host_run_seconds(self.model)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.nxt = self.dec.step(self.nxt).argmax(-1)
        self.dec.synchronize()
        return (time.perf_counter() - t0) / steps, _host_run_seconds(self.model) / steps


def decode_rate(torch, model, batch: int, steps: int, capture: bool, device, vocab: int,
                attention: str = "auto", prompt_len: int = 16) -> float:
    """Seconds per decode step over one block of `steps` (DecodeRun)."""
    return DecodeRun(torch, model, batch, steps, capture, device, vocab, attention, prompt_len).block(steps)[0]


def prefill_seconds(torch, model, tokens: int, device, vocab: int, repeats: int = 2) -> float:
    import hmoe.nn as hn

    dec = hn.GraphDecoder(model, batch_size=1, max_cache_len=tokens + 1, capture=False)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(7)).to(device)
    dec.prefill(ids)
    _sync(torch, device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dec.prefill(ids)
        _sync(torch, device)
        best = min(best, time.perf_counter() - t0)
    return best


class ExpertsAlone:
    """The CPU experts of every layer for one decode step of `batch` tokens with random routing, called
    directly (no GPU, no copies): block(n) -> seconds per step over n steps; `distinct` = distinct
    experts per layer."""

    def __init__(self, torch, model, batch: int):
        import hmoe.nn as hn

        blocks = [m for m in model.modules() if isinstance(m, hn.HybridMoE)]
        g = torch.Generator().manual_seed(batch)
        self.calls, distinct = [], 0
        for b in blocks:
            E, K = b.experts.num_experts, b.top_k
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(batch)]).to(torch.int32)
            w = torch.rand(batch, K, generator=g)
            x = torch.randn(batch, b.hidden_size, generator=g).to(b.gate_weight.dtype)
            self.calls.append((b.experts, x, ids, w))
            distinct += ids.unique().numel()
        self.distinct = distinct / max(1, len(blocks))
        self.block(1)  # warm-up

    def block(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            for experts, x, ids, w in self.calls:
                experts(x, ids, w)
        return (time.perf_counter() - t0) / steps


def paired(run: DecodeRun, alone: ExpertsAlone, rounds: int, steps: int) -> dict:
    """`rounds` rounds of a block of `steps` decode steps, each followed by a block of as many steps of
    the CPU experts alone: the host's drift (its load, the experts' own speed) moves both blocks of a
    round alike, so each round gives a ratio, and the medians over the rounds are the result."""
    step, inside, solo, ratio = [], [], [], []
    for _ in range(rounds):
        s, i = run.block(steps)
        a = alone.block(steps)
        step.append(s), inside.append(i), solo.append(a), ratio.append(s / a)
    return {"s": statistics.median(step), "inside_s": statistics.median(inside),
            "alone_s": statistics.median(solo), "ratio": statistics.median(ratio),
            "ratio_range": (min(ratio), max(ratio))}


def graph_row(how: str, opts) -> str:
    """The name of the CUDA-graph decode row with hand-over `how`."""
    return "cuda graph" if how == opts.handovers[0] else f"cuda graph, {how}"


def baseline(torch, opts, dtype, device, vocab: int) -> dict:
    """transformers with the routed experts offloaded to the CPU by accelerate (or, with --cpu-only,
    transformers on the CPU): decode s/step at batch 1 and prefill seconds."""
    from hmoe.bench import models

    model = models.build(opts.preset, dtype=dtype, device=device, layers=opts.layers)
    how = "transformers on the CPU"
    if device.type == "cuda":
        from accelerate import dispatch_model

        dmap = {"": device.index or 0}
        dmap.update({n: "cpu" for n, m in model.named_modules() if hasattr(m, "gate_up_proj")})
        model = dispatch_model(model, device_map=dmap, main_device=device.index or 0)
        how = "transformers + accelerate dispatch_model (routed experts offloaded to the CPU)"
    out = {"how": how, "decode_s": {}}
    with torch.no_grad():
        for batch in opts.batches[:1]:
            out["decode_s"][batch] = decode_rate(torch, model, batch, opts.baseline_steps, False, device, vocab,
                                                 attention="model", prompt_len=opts.prompt)
        if opts.prefill:
            out["prefill_s"] = prefill_seconds(torch, model, opts.prefill, device, vocab, repeats=1)
    del model
    return out


def transformers_missing() -> str | None:
    """Why the transformers this bench needs cannot be used (not installed, does not import, too old for
    DeepSeek-V2/V3), or None."""
    try:
        import transformers
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "transformers":
            return "it is not installed"
        return f"it does not import ({type(e).__name__}: {e})"
    if not all(hasattr(transformers, c) for c in ("DeepseekV2Config", "DeepseekV3Config")):
        return f"transformers {getattr(transformers, '__version__', '?')} has no DeepSeek-V2/V3 models"
    return None


def main(argv=None, prog="python -m hmoe.bench e2e") -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv, prog)
    why = transformers_missing()
    if why:
        print(f"{prog}: this bench needs transformers (it builds the DeepSeek models with it), but {why}: "
              f"{NEEDS_TRANSFORMERS}", file=sys.stderr)
        return 2
    import torch

    import hmoe
    import hmoe.nn as hn
    from hmoe.bench import membw, models

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[opts.dtype]
    device = torch.device("cpu" if opts.cpu_only or not torch.cuda.is_available() else "cuda:0")
    cfg = models.config(opts.preset, opts.layers)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    print(f"hmoe.bench e2e  preset {opts.preset}: {moe_layers} MoE layers, {cfg.n_routed_experts} experts top-"
          f"{cfg.num_experts_per_tok}, H={cfg.hidden_size} I={cfg.moe_intermediate_size}, {opts.dtype}  "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}  "
          f"cpu: {membw.cpu_model()}  threads {hmoe.get_num_threads()}  torch {torch.__version__}  "
          f"decode after a {opts.prompt}-token prompt")
    progress("measuring the host's read bandwidth")
    read = membw.measure_read_bandwidth()
    progress(f"read bandwidth {read['gbps']:.1f} GB/s; building the model")
    t0 = time.perf_counter()
    model = models.build(opts.preset, dtype=dtype, device=device, layers=opts.layers)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = hn.patch_model(model, progress=sys.stderr.isatty())
    patched = time.perf_counter() - t0
    print(f"built in {built:.1f} s, patched in {patched:.1f} s")
    print(report)
    expert_bytes = models.routed_expert_bytes(cfg, torch.empty(0, dtype=dtype).element_size())
    rows, result = [], {"preset": opts.preset, "dtype": opts.dtype, "device": str(device), "read_bw": read,
                        "moe_layers": moe_layers, "decode": {}, "prefill": {}}
    vocab = cfg.vocab_size
    with torch.no_grad():
        for batch in opts.batches:
            progress(f"decode batch {batch}")
            alone = ExpertsAlone(torch, model, batch)
            bound_s = moe_layers * alone.distinct * expert_bytes / (read["gbps"] * 1e9)
            entry = {"distinct_experts_per_layer": alone.distinct, "bound_s": bound_s}
            modes = [("eager", False, opts.handovers[0], "auto")]
            if device.type == "cuda":
                modes += [(graph_row(h, opts), True, h, "auto") for h in opts.handovers]
                modes.append((MODEL_ATTENTION, True, opts.handovers[0], "model"))
            solo = []
            for name, capture, how, attention in modes:
                with handover(how):
                    run = DecodeRun(torch, model, batch, opts.rounds * opts.steps, capture, device, vocab, attention,
                                    opts.prompt)
                    res = paired(run, alone, opts.rounds, opts.steps)
                entry[name], entry[f"{name} cpu experts inside"] = res["s"], res["inside_s"]
                entry[f"{name} / cpu experts alone"], entry[f"{name} ratio range"] = res["ratio"], res["ratio_range"]
                entry[f"{name} attention"] = run.reason
                solo.append(res["alone_s"])
                del run
            entry["cpu_experts_alone_s"] = statistics.median(solo)
            result["decode"][batch] = entry
        if opts.prefill:
            progress(f"prefill {opts.prefill} tokens")
            result["prefill"]["hmoe_s"] = prefill_seconds(torch, model, opts.prefill, device, vocab)
    del model, report
    if not opts.no_baseline:
        progress("baseline: " + ("transformers + accelerate offload" if device.type == "cuda" else "transformers"))
        try:
            result["baseline"] = baseline(torch, opts, dtype, device, vocab)
        except ImportError as e:
            result["baseline"] = {"error": f"{e}"}
    base = result.get("baseline", {})
    print(f"\nread bandwidth {read['gbps']:.1f} GB/s ({read['method']}); one routed expert {expert_bytes / 1e6:.1f} MB; "
          f"bound = {moe_layers} layers x distinct experts per layer x expert bytes / read bandwidth")
    if "error" in base:
        print(f"baseline unavailable: {base['error']}")
    elif base:
        print(f"baseline: {base['how']}")
    first = next(iter(result["decode"].values()), {})
    if "cuda graph attention" in first:
        print(f"attention in the decode steps: {first['cuda graph attention']}; row '{MODEL_ATTENTION}': "
              f"{first[MODEL_ATTENTION + ' attention']} (transformers' own, the same graph otherwise)")
    if device.type == "cuda":
        print(f"hand-over of the CPU experts: {opts.handovers[0]} (HMOE_CPU_HANDOVER; the rows 'cuda graph, <name>' "
              "use another); cpu inside = the CPU experts' own run time inside the step; the rest of the step is "
              "the GPU's serial work between layers and the hand-over to and from the CPU")
    print(f"each decode row: {opts.rounds} rounds of {opts.steps} steps, each round followed by as many steps of the "
          "CPU experts alone (direct calls, random routing); medians over the rounds: ms/step, / cpu experts (the "
          "ratio of each round's two blocks), cpu inside; 'rounds' = the lowest and highest round ratio")
    head = (f"{'decode':<30}{'tok/s':>10}{'ms/step':>10}{'% bound':>9}{'x base':>9}{'/ cpu experts':>15}"
            f"{'rounds':>16}{'cpu inside':>12}")
    print(head + "\n" + "-" * len(head))
    for batch, e in result["decode"].items():
        b_s = base.get("decode_s", {}).get(batch)
        for name in [graph_row(h, opts) for h in opts.handovers] + [MODEL_ATTENTION, "eager"]:
            if name in e:
                s = e[name]
                rows.append(name)
                inside = e[f"{name} cpu experts inside"]
                print(f"{f'hmoe {name}, B={batch}':<30}{batch / s:>10.2f}{s * 1e3:>10.2f}{100 * e['bound_s'] / s:>8.1f}%"
                      f"{(f'{b_s / s:.1f}x' if b_s else '-'):>9}{e[f'{name} / cpu experts alone']:>14.2f}x"
                      f"{'{:.2f}-{:.2f}x'.format(*e[f'{name} ratio range']):>16}"
                      f"{(f'{inside * 1e3:.2f} ms' if inside else '-'):>12}")
        print(f"{f'CPU experts alone B={batch}':<30}{batch / e['cpu_experts_alone_s']:>10.2f}"
              f"{e['cpu_experts_alone_s'] * 1e3:>10.2f}{100 * e['bound_s'] / e['cpu_experts_alone_s']:>8.1f}%")
        print(f"{f'bound B={batch}':<30}{batch / e['bound_s']:>10.2f}{e['bound_s'] * 1e3:>10.2f}"
              f"   ({e['distinct_experts_per_layer']:.1f} distinct experts per layer)")
        if b_s:
            print(f"{f'baseline B={batch}':<30}{batch / b_s:>10.2f}{b_s * 1e3:>10.2f}")
    if opts.prefill:
        s, b_s = result["prefill"]["hmoe_s"], base.get("prefill_s")
        print(f"\nprefill {opts.prefill} tokens: hmoe {opts.prefill / s:.0f} tok/s ({s * 1e3:.0f} ms)"
              + (f", baseline {opts.prefill / b_s:.0f} tok/s ({b_s * 1e3:.0f} ms), {b_s / s:.1f}x" if b_s else ""))
    print("\ngoals (V2-Lite, B=1, bf16, H200 host): CUDA graph decode >= 70% of the bound and >= 10x the baseline; "
          "decode step <= 1.1x the CPU experts alone")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
