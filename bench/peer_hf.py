#!/usr/bin/env python3
"""The peer of bench/train_bench.sh: Hugging Face transformers (+ PEFT for
LoRA) training the same model directory on the same documents as `loom
train`, printing the same per-step line:

  step N/M | loss X | grad norm G | lr L | T tokens/s

and at the end `peak GPU memory X GiB` (torch.cuda.max_memory_reserved).

  peer_hf.py --model DIR --data DOCS.npy --steps N --micro-batch-size B
             [--grad-accum G] [--lora-r 8 --lora-alpha 16] [--base-dtype bf16|fp32]

Setup (bench/README.md): AutoModelForCausalLM.from_pretrained(DIR, dtype
fp32 for full fine-tuning / bf16 for a frozen LoRA base,
attn_implementation="sdpa", local_files_only=True) on one GPU;
forward and loss under torch.autocast(bfloat16), backward outside it;
gradient checkpointing off; PEFT LoraConfig(r, lora_alpha,
target_modules="all-linear", lora_dropout=0.0) with fp32 adapter weights;
torch.optim.AdamW(fused=True, betas (0.9, 0.999), eps 1e-8, weight decay 0),
constant lr; clip_grad_norm_(1.0). Step s takes rows (s-1)*G*B .. s*G*B-1
of DOCS.npy (wrapping at the end, as loom's packer does) as G micro-batches
of B rows (G = --grad-accum, default 1), each micro-batch's loss divided by
G and backpropagated before the next, labels = input_ids (HF shifts them:
the mean loss over the S-1 next-token targets of each row).
Each step is timed from the batch upload to the optimizer step's end with
torch.cuda.synchronize() on both sides.
"""
import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

np = None  # numpy and torch, imported by run() once the arguments are checked
torch = None

GiB = float(1 << 30)


def log(msg):
    print(msg, flush=True)


def version_tuple(v):
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def load_model(args, device):
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.base_dtype]
    kw = dict(attn_implementation="sdpa", local_files_only=True)
    # transformers 4.56 renamed torch_dtype to dtype (the old name still works, with a warning)
    if version_tuple(transformers.__version__) >= (4, 56):
        kw["dtype"] = dtype
    else:
        kw["torch_dtype"] = dtype
    direct = False
    if device.type == "cuda":
        try:
            import accelerate  # noqa: F401  (device_map needs it)
            kw["device_map"] = {"": device.index if device.index is not None else 0}
            direct = True
        except ImportError:
            pass
    model = AutoModelForCausalLM.from_pretrained(args.model, **kw)
    if not direct:
        model = model.to(device)
    return model


def delta_rule_impl(model):
    """Which Gated DeltaNet kernels transformers bound for this model: it takes
    flash-linear-attention's `chunk_gated_delta_rule` when `import fla`
    succeeds when its modeling file loads (fla needs Triton >= 3.7.1 on
    Hopper), else its torch reference. None for a model without such layers.
    The same import, repeated here, names the reason when it fails."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or \
        getattr(getattr(cfg, "text_config", None), "layer_types", None) or []
    if "linear_attention" not in types:
        return None, ""
    try:
        import importlib
        fla = importlib.import_module("fla")
        if getattr(fla, "chunk_gated_delta_rule", None) is None:
            importlib.import_module("fla.ops.gated_delta_rule")
        import triton
        return "fla", f"flash-linear-attention {getattr(fla, '__version__', '?')}, " \
                      f"triton {triton.__version__}"
    except Exception as e:  # what transformers' fallback swallows
        return "torch", f"torch reference (import fla: {type(e).__name__}: {e})"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="HF transformers/PEFT peer of loom train")
    ap.add_argument("--model", required=True, help="HF model directory (loom init --out)")
    ap.add_argument("--data", required=True, help="int32 (N, S) .npy from bench/make_data.py")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches a step (loom's --global-batch-size / micro-batch size)")
    ap.add_argument("--seq-len", type=int, default=0, help="check the rows have this length")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--lora-r", type=int, default=0, help="0: full fine-tuning")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--base-dtype", choices=["fp32", "bf16"], default=None,
                    help="dtype of the loaded weights (default: bf16 with LoRA, fp32 without)")
    ap.add_argument("--autocast", choices=["bf16", "none"], default="bf16",
                    help="torch.autocast dtype of forward and loss (none: plain base dtype)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=1234, help="torch seed (LoRA A init)")
    ap.add_argument("--no-fused", action="store_true", help="AdamW without fused=True")
    ap.add_argument("--grad-ckpt", action="store_true",
                    help="gradient checkpointing (a MoE model too large for the GPU without it)")
    ap.add_argument("--require-fla", action="store_true",
                    help="refuse to run a Gated DeltaNet model on transformers' torch reference "
                         "(the transformers + flash-linear-attention peer)")
    args = ap.parse_args(argv)
    # counts refused here, before torch is imported (bench/probe_args.sh runs these anywhere)
    for name, v, low in (("--steps", args.steps, 1), ("--micro-batch-size", args.micro_batch_size, 1),
                         ("--grad-accum", args.grad_accum, 1), ("--lora-r", args.lora_r, 0)):
        if v < low:
            ap.error(f"{name} {v}: give a count of at least {low}")
    return args


def main(args):
    if args.base_dtype is None:
        args.base_dtype = "bf16" if args.lora_r else "fp32"

    import transformers
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    try:
        import peft
        peft_v = peft.__version__
    except ImportError:
        peft = None
        peft_v = "not installed"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            sys.exit("peer: --device cuda but torch sees no GPU")
        if device.index is None:  # the cuda.* memory calls want an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    log(f"peer: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft_v}, device {torch.cuda.get_device_name(device) if cuda else device}")

    docs = np.load(args.data)
    if docs.ndim != 2 or docs.dtype != np.int32:
        sys.exit(f"peer: {args.data}: expected an int32 (N, S) array, got {docs.dtype} {docs.shape}")
    n_docs, S = docs.shape
    if args.seq_len and S != args.seq_len:
        sys.exit(f"peer: {args.data} has rows of {S} tokens, --seq-len is {args.seq_len}")
    B = args.micro_batch_size
    GA = args.grad_accum

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def synced_reset():
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = load_model(args, device)
    model.config.use_cache = False
    if args.lora_r:
        if peft is None:
            sys.exit("peer: --lora-r needs peft (pip install peft)")
        from peft import LoraConfig, get_peft_model
        kw = {}
        if getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0):
            # transformers 5's fused experts are parameters, not linears: PEFT's
            # LoRA on them is target_parameters (one A, B per expert)
            kw["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        lc = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear",
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **kw)
        model = get_peft_model(model, lc)
        # fp32 master weights for the adapter (PEFT's autocast_adapter_dtype does this
        # already for a bf16 base; made sure here)
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.train()
    with warnings.catch_warnings():  # transformers v5 deprecates the name
        warnings.simplefilter("ignore")
        gc = getattr(model, "is_gradient_checkpointing", False)
    if gc and not args.grad_ckpt:
        sys.exit("peer: gradient checkpointing is on; the benchmark runs without it")
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.lora_r:
            model.enable_input_require_grads()
        log("peer: gradient checkpointing on")
    impl, why = delta_rule_impl(model)
    if impl is not None:
        log(f"peer: gated delta rule: {why}")
        if args.require_fla and impl != "fla":
            sys.exit("peer: --require-fla, but transformers runs its torch reference: install "
                     "fla-core with a Triton >= 3.7.1")
    ei = getattr(model.config, "_experts_implementation", None)
    if ei is not None:
        log(f"peer: experts implementation {ei}")
    sync()
    params = [p for p in model.parameters() if p.requires_grad]
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in params)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    log(f"peer: loaded {args.model} in {time.perf_counter() - t0:.1f} s: "
        f"{n_total:,} parameters ({'/'.join(dtypes)}), {n_train:,} trainable"
        f"{f' (LoRA r={args.lora_r} alpha={args.lora_alpha:g} all-linear)' if args.lora_r else ''}; "
        f"attn {getattr(model.config, '_attn_implementation', '?')}, autocast {args.autocast}")
    if cuda:
        log(f"peer: memory after load: {torch.cuda.memory_allocated(device) / GiB:.2f} GiB allocated")

    try:
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=args.weight_decay, fused=not args.no_fused)
    except (RuntimeError, TypeError, ValueError) as e:
        log(f"peer: fused AdamW refused ({e}); using the default implementation")
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=args.weight_decay)
    ac_enabled = args.autocast != "none"
    synced_reset()

    def report_memory():
        if cuda:
            free_b, total_b = torch.cuda.mem_get_info(device)
            log(f"peak GPU memory {torch.cuda.max_memory_reserved(device) / GiB:.2f} GiB "
                f"(torch max_memory_reserved; max_memory_allocated "
                f"{torch.cuda.max_memory_allocated(device) / GiB:.2f} GiB; "
                f"{(total_b - free_b) / GiB:.2f} GiB on the device with the CUDA context and "
                f"libraries)")
        else:
            log("peak GPU memory n/a (not on a GPU)")

    step = 0
    first = last = float("nan")
    tokens_total = 0
    t_start = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            sync()
            t0 = time.perf_counter()
            lsum = 0.0
            for k in range(GA):  # the step's micro-batches, each loss 1/GA of the mean
                first_row = ((step - 1) * GA + k) * B
                rows = [(first_row + i) % n_docs for i in range(B)]
                x = torch.from_numpy(docs[rows]).to(device=device, dtype=torch.long)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                    enabled=ac_enabled):
                    loss = model(input_ids=x, labels=x, use_cache=False).loss / GA
                loss.backward()
                lsum = lsum + loss.detach()
            gn = torch.nn.utils.clip_grad_norm_(params, args.clip_grad) if args.clip_grad > 0 \
                else torch.nn.utils.clip_grad_norm_(params, float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            lv, gv = float(lsum), float(gn)
            sync()
            dt = time.perf_counter() - t0
            tokens_total += GA * B * S
            if step == 1:
                first = lv
            last = lv
            log(f"step {step}/{args.steps} | loss {lv:.4f} | grad norm {gv:.3f} | "
                f"lr {opt.param_groups[0]['lr']:.3e} | {GA * B * S / dt:.0f} tokens/s")
    except torch.cuda.OutOfMemoryError as e:
        log(f"peer: OOM (CUDA out of memory) at step {step}: {str(e).splitlines()[0]}")
        report_memory()
        return 3
    total = time.perf_counter() - t_start
    log(f"trained {args.steps} steps in {total:.1f} s ({tokens_total / total:.0f} tokens/s): "
        f"loss {first:.4f} -> {last:.4f}")
    report_memory()
    return 0


def run():
    global np, torch
    args = parse_args()
    import numpy as np
    import torch
    try:
        return main(args)
    except torch.cuda.OutOfMemoryError as e:  # while loading or setting up
        log(f"peer: OOM (CUDA out of memory) before the first step: {str(e).splitlines()[0]}")
        if torch.cuda.is_available():
            log(f"peak GPU memory {torch.cuda.max_memory_reserved() / GiB:.2f} GiB "
                f"(torch max_memory_reserved, before training)")
        sys.exit(3)


if __name__ == "__main__":
    sys.exit(run())
