"""The SFT study on the shipped k3-mini: base vs LoRA (over the packed MXFP4 experts: QLoRA) vs a full
fine-tune of the same budget, scored on the held-out chat set (answer-token loss, greedy exact match).

    .venv/bin/python experiments/sft/run_sft.py --steps 200 --out experiments/runs/sft/      # resumable per arm
    .venv/bin/python experiments/sft/run_sft.py --out experiments/runs/sft/ --rescore        # score again, + merged
    .venv/bin/python experiments/sft/run_sft.py --steps 2 --batch 2 --seq-len 64 --arms lora_shared_a --out /tmp/s

Arms: ``base`` (the shipped model, untrained), ``lora`` (``--lora``: one A and one B per routed expert),
``lora_shared_a`` (``--lora`` + ``experts_shared_a=true``: one A per layer's routed stack shared by its experts, B per
expert, so fewer routed-expert parameters) and ``full`` (every weight, per-head Muon). The LoRA arms record
``trainable_params`` (the adapter) and ``expert_adapter_params`` (its routed-expert part).

Each arm is one `k3 train` run (k3jax.train.loop.train) from the shipped checkpoint on experiments/sft/chat_train.jsonl
(packed rows with document masks, loss on the assistant's tokens only); its result JSON is written once the arm is
scored, and an arm whose JSON exists is not run again (an export left by an arm that stopped before its JSON is
replaced). A LoRA arm exports its adapter (PEFT layout; the shared-A arm's sidecar records the flag) and the full
fine-tune its checkpoint; ``--rescore`` scores every arm again from those files (a LoRA arm's adapter must load back
with the sharing it trained with) and adds a merged arm per adapter ("merged" from lora, "merged_shared_a" from
lora_shared_a): the adapter merged into the base with the experts re-quantized to MXFP4 (k3jax.checkpoint.merge),
written, reloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))


def score(params, cfg, run, heldout, *, ckpt=None):
    from k3jax.train.chat_eval import answer_loss, exact_match

    nats, n = answer_loss(params, cfg, run, heldout, ckpt=ckpt)
    return {"answer_nats": nats, "answer_tokens": n, "exact_match": exact_match(params, cfg, run, heldout, ckpt=ckpt)}


def tree_size(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def expert_size(adapters) -> int:
    """Parameters of the routed-expert adapters (the leaves under a ``moe.experts`` block) in an adapter tree."""
    return sum(int(x.size) for path, x in jax.tree_util.tree_leaves_with_path(adapters)
               if "experts" in (getattr(k, "key", None) for k in path))


LORA_ARMS = {"lora": False, "lora_shared_a": True}  # LoRA arm -> experts_shared_a


def lora_spec(arm: str, spec: str) -> str:
    """The --lora text an arm trains with: ``spec``, with experts_shared_a=true appended for the shared-A arm."""
    return f"{spec},experts_shared_a=true" if LORA_ARMS[arm] else spec


def main(argv=None):
    from k3jax.checkpoint.source import default_ckpt, load_model
    from k3jax.cli.train import parse_lora
    from k3jax.layers.lora import split_adapters
    from k3jax.train.loop import train
    from k3jax.train.settings import TrainConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr-lora", type=float, default=3e-3)
    ap.add_argument("--lr-full", type=float, default=1e-3)
    ap.add_argument("--lora", default="rank=16,alpha=32,targets=attn+shared+experts")
    ap.add_argument("--arms", default="base,lora,full", help="comma-separated: base, lora, lora_shared_a, full")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "runs", "sft"))
    ap.add_argument("--rescore", action="store_true", help="score every arm again from its files, + the merged arm")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ckpt = default_ckpt()
    train_file, heldout = os.path.join(HERE, "chat_train.jsonl"), os.path.join(HERE, "chat_heldout.jsonl")
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ("base", "full", *LORA_ARMS)]
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; expected base, lora, lora_shared_a, full")
    cfg, run, base = load_model(ckpt=ckpt, preset=None)
    common = dict(preset=None, init=ckpt, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                  data=(train_file,), eval_every=max(args.steps // 4, 1), progress=False)
    for arm in arms:
        path = os.path.join(args.out, f"{arm}.json")
        if os.path.exists(path):
            print(f"{arm}: {path} exists, skipped")
            continue
        t0 = time.time()
        rec = {"arm": arm, "steps": 0 if arm == "base" else args.steps, "batch": args.batch, "seq_len": args.seq_len}
        if arm == "base":
            rec.update(score(base, cfg, run, heldout))
        else:
            spec = lora_spec(arm, args.lora) if arm in LORA_ARMS else None
            lora = parse_lora(spec) if spec else None
            tc = TrainConfig(**common, lr=args.lr_lora if lora else args.lr_full, lora=lora,
                             optimizer="adamw" if lora else "per_head",
                             export=os.path.join(args.out, f"{arm}-export"), overwrite=True)
            summary = train(tc)
            params = summary["params"]
            run_arm = run.replace(lora=lora)
            trained = split_adapters(params)[0] if lora else params
            rec.update(lr=tc.lr, lora=spec, optimizer=tc.optimizer,
                       trainable_params=tree_size(trained), total_params=tree_size(params),
                       train_evals=summary["evals"], final_loss=summary["final_loss"])
            if lora:
                rec["expert_adapter_params"] = expert_size(trained)
            rec.update(score(params, cfg, run_arm, heldout))
        rec["seconds"] = time.time() - t0
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f, indent=1)
        os.replace(path + ".tmp", path)
        print(json.dumps({k: v for k, v in rec.items() if k != "train_evals"}))
    if args.rescore:
        rescore(args.out, ckpt, heldout)
    jax.clear_caches()


def rescore(out, ckpt, heldout):
    """Every arm scored again from what it wrote (base: the shipped checkpoint; lora, lora_shared_a: base + its
    adapter, which must load back with the experts_shared_a it trained with and as many parameters; full: its
    export), plus per adapter a merged arm ("merged", "merged_shared_a"): the adapter merged into the base, MXFP4
    experts re-quantized, written and reloaded."""
    from k3jax.checkpoint.load import load
    from k3jax.checkpoint.merge import merge_adapter
    from k3jax.checkpoint.peft import load_adapter
    from k3jax.checkpoint.save import save
    from k3jax.checkpoint.source import load_model
    from k3jax.config import default_run
    from k3jax.layers.experts import merge_trees
    from k3jax.layers.lora import split_adapters

    arms = {"base": (ckpt, None), "full": (os.path.join(out, "full-export"), None)}
    arms |= {arm: (ckpt, os.path.join(out, f"{arm}-export")) for arm in LORA_ARMS}
    for arm, (src, adapter) in arms.items():
        path = os.path.join(out, f"{arm}.json")
        if not os.path.exists(path) or not os.path.exists(src) or (adapter and not os.path.exists(adapter)):
            continue
        cfg, run, params = load_model(ckpt=src, preset=None, adapter=adapter)
        rec = json.load(open(path))
        if adapter:
            loaded = tree_size(split_adapters(params)[0])
            if run.lora.experts_shared_a != LORA_ARMS[arm] or loaded != rec["trainable_params"]:
                raise RuntimeError(f"{adapter}: loaded experts_shared_a={run.lora.experts_shared_a} with {loaded} "
                                   f"parameters; the arm trained experts_shared_a={LORA_ARMS[arm]} with "
                                   f"{rec['trainable_params']}")
            rec.update(loaded_experts_shared_a=run.lora.experts_shared_a, loaded_adapter_params=loaded)
        rec |= score(params, cfg, run, heldout)
        json.dump(rec, open(path, "w"), indent=1)
        print(arm, rec["answer_nats"], rec["exact_match"]["all"])
    for arm, name in (("lora", "merged"), ("lora_shared_a", "merged_shared_a")):
        adapter = os.path.join(out, f"{arm}-export")
        if not os.path.exists(adapter):
            continue
        cfg, base = load(ckpt)
        lora, leaves = load_adapter(adapter, cfg, default_run(cfg))
        merged, report = merge_adapter(merge_trees(base, leaves), cfg, lora)
        save(merged, cfg, os.path.join(out, f"{name}-export"), overwrite=True)
        _, reloaded = load(os.path.join(out, f"{name}-export"))
        rec = {"arm": name, "adapter": adapter, "experts_shared_a": lora.experts_shared_a,
               "requantization": report["summary"]}
        rec.update(score(reloaded, cfg, default_run(cfg), heldout))
        json.dump(rec, open(os.path.join(out, f"{name}.json"), "w"), indent=1)
        print(name, rec["answer_nats"], rec["exact_match"]["all"], report["summary"])


if __name__ == "__main__":
    main()
