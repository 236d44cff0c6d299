"""Structured output's cost: decode tokens/s unconstrained vs JSON-schema constrained,
and compile time per schema (cold and cached), per grammar backend.

Decode: B sequences with --context-len cached tokens each, then --decode-steps greedy
steps through actorlm's ModelRunner, every row free or every row constrained by one
JSON schema (a matcher that finishes starts again, so each step pays for B masks).
The constrained step is the worker's: masks fill on the grammar thread while the
forward pass runs (one batch call per backend), the sampler's argmax reads them
(gpu/kernels/bitmask.py), the matchers then take their tokens (one batch call). Free and constrained runs alternate, best of --repeats kept, so
both see the same drift of a shared machine.

Compile: each schema of a set like users send (a tool call, a GitHub issue, a
package.json, an OpenAPI-ish operation, nested $defs, anyOf, patterns), through the
grammar manager: cold (first compile) and cached (the same schema again: the cache
look-up plus the copy a request gets).

    python bench/grammar.py                       # default model, batch 1 8 32, both backends
    python bench/grammar.py --batch-sizes 32 --backends xgrammar
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from actorlm.actors.tokenizer.tokenization import load_tokenizer
from actorlm.config import GrammarConfig, ModelConfig
from actorlm.gpu.grammar import GrammarContext
from actorlm.gpu.grammar.manager import GrammarManager, GrammarSetup
from actorlm.gpu.loaders.base import model_path
from actorlm.gpu.runner import ModelRunner
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep

# A long-running answer: records with free text, so a small model writes for a while.
DECODE_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "note": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 0},
                },
                "required": ["name", "note", "qty"],
            },
        }
    },
    "required": ["items"],
}
_STR = {"type": "string"}
COMPILE_SCHEMAS: dict[str, dict[str, Any]] = {
    "tool-call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search", "send_email"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": _STR,
                    "unit": {"enum": ["C", "F"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city"],
            },
        },
        "required": ["name", "arguments"],
    },
    "github-issue": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 256},
            "body": _STR,
            "labels": {
                "type": "array",
                "items": {"enum": ["bug", "feature", "docs", "question"]},
                "uniqueItems": True,
            },
            "assignees": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[A-Za-z0-9-]{1,39}$"},
                "maxItems": 10,
            },
            "milestone": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["title", "body"],
    },
    "package-json": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9-~][a-z0-9-._~]*$", "maxLength": 214},
            "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
            "description": _STR,
            "keywords": {"type": "array", "items": _STR},
            "license": _STR,
            "private": {"type": "boolean"},
            "scripts": {"type": "object", "additionalProperties": _STR},
            "dependencies": {"type": "object", "additionalProperties": _STR},
        },
        "required": ["name", "version"],
    },
    "openapi-operation": {
        "type": "object",
        "properties": {
            "operationId": _STR,
            "method": {"enum": ["get", "post", "put", "delete", "patch"]},
            "path": {"type": "string", "pattern": "^/[a-z0-9/{}_-]*$"},
            "parameters": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": _STR,
                        "in": {"enum": ["query", "path", "header"]},
                        "required": {"type": "boolean"},
                    },
                    "required": ["name", "in"],
                },
            },
            "responses": {
                "type": "object",
                "additionalProperties": {"type": "object", "properties": {"description": _STR}},
            },
        },
        "required": ["operationId", "method", "path"],
    },
    "person-address": {
        "$defs": {
            "address": {
                "type": "object",
                "properties": {
                    "street": _STR,
                    "city": _STR,
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "country": {"type": "string", "minLength": 2, "maxLength": 2},
                },
                "required": ["street", "city", "country"],
            }
        },
        "type": "object",
        "properties": {
            "name": _STR,
            "birthday": {"type": "string", "format": "date"},
            "email": {"type": "string", "format": "email"},
            "home": {"$ref": "#/$defs/address"},
            "work": {"$ref": "#/$defs/address"},
        },
        "required": ["name", "home"],
    },
    "calendar-event": {
        "type": "object",
        "properties": {
            "summary": _STR,
            "start": {"type": "string", "format": "date-time"},
            "end": {"type": "string", "format": "date-time"},
            "attendees": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"email": _STR, "optional": {"type": "boolean"}},
                    "required": ["email"],
                },
                "maxItems": 50,
            },
            "recurrence": {"anyOf": [{"enum": ["daily", "weekly", "monthly"]}, {"type": "null"}]},
        },
        "required": ["summary", "start", "end"],
    },
    "product-catalog": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
                "stock": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": _STR},
                "dimensions": {
                    "type": "object",
                    "properties": {
                        "w": {"type": "number"},
                        "h": {"type": "number"},
                        "d": {"type": "number"},
                    },
                },
            },
            "required": ["sku", "price", "currency"],
        },
        "minItems": 1,
    },
    "json-object": {"type": "object"},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="", help="HF folder or .gguf file (default: the embedded SmolLM2 GGUF)"
    )
    p.add_argument(
        "--backends", default="xgrammar,llguidance", help="grammar backends, comma-separated"
    )
    p.add_argument("--batch-sizes", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument(
        "--context-len", type=int, default=64, help="cached tokens per sequence before decoding"
    )
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each workload (best kept)")
    p.add_argument(
        "--compile-repeats", type=int, default=20, help="cached compiles timed per schema (median)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", default="bench/results/grammar.json", help="raw results (JSON)")
    return p.parse_args()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "Flags", "CPU(s)"):
            info["cpu_" + key.strip().split()[0].lower().strip("()")] = value.strip()
    import importlib.metadata as md

    for dist in ("xgrammar", "llguidance"):
        info[dist] = md.version(dist)
    return info


class Timed:
    """Seconds spent in parts of the step, by wrapping them on their instances: the
    sampler (masks applied there), the matchers' fill (on the mask thread, beside the
    forward pass) and accept (after sampling)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.spent = {"sample": 0.0, "fill": 0.0, "accept": 0.0}
        self._wrap(runner.sampler, "sample", "sample")
        self._wrap(runner, "_advance_grammars", "accept")
        self._managers: set[int] = set()

    def _wrap(self, obj: Any, attr: str, key: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def attach(self, manager: GrammarManager) -> None:
        if id(manager) not in self._managers:
            self._managers.add(id(manager))
            self._wrap(manager, "fill", "fill")

    def reset(self) -> None:
        for key in self.spent:
            self.spent[key] = 0.0


class Decoder:
    """B sequences decoding through one ModelRunner, free or constrained."""

    def __init__(self, runner: ModelRunner, batch: int, context_len: int, steps: int) -> None:
        self.runner = runner
        vocab = runner.info.vocab_size
        g = torch.Generator().manual_seed(batch)
        self.prompts = [
            torch.randint(100, vocab - 100, (context_len,), generator=g).tolist()
            for _ in range(batch)
        ]
        ps = runner.info.page_size
        per_seq = -(-(context_len + steps + 2) // ps)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        self.steps = steps
        self.step_id = 0
        self.timed: Timed | None = None

    def _forward(self, seqs: list[SeqStep], release: list[str] | None = None) -> dict[str, int]:
        self.step_id += 1
        res = self.runner.forward(
            ForwardBatch(step_id=self.step_id, seqs=seqs, release=release or [])
        )
        assert not res.errors, res.errors
        return {r.rid: r.token_id for r in res.results}

    def run(self, sampling: SamplingParams) -> float:
        """Tokens/s of the timed steps (one untimed step warms the decode path)."""
        rids = [f"r{i}" for i in range(len(self.prompts))]
        inits = [SeqInit(sampling=sampling, token_ids=p, prompt_len=len(p)) for p in self.prompts]
        tokens = self._forward(
            [
                SeqStep(r, p, 0, t, True, init)
                for r, p, t, init in zip(rids, self.prompts, self.tables, inits, strict=True)
            ]
        )
        pos = len(self.prompts[0])
        elapsed = 0.0
        for step in range(self.steps + 1):
            if step == 1 and self.timed is not None:
                self.timed.reset()  # the timed steps only
            t0 = time.perf_counter()
            tokens = self._forward(
                [SeqStep(r, [tokens[r]], pos, t) for r, t in zip(rids, self.tables, strict=True)]
            )
            if step:
                elapsed += time.perf_counter() - t0
            pos += 1
            self._restart_finished(rids, inits)
        self._forward([], release=rids)
        return len(rids) * self.steps / elapsed

    def _restart_finished(self, rids: list[str], inits: list[SeqInit]) -> None:
        grammars = self.runner.grammars
        if grammars is None:
            return
        for rid, init in zip(rids, inits, strict=True):
            live = grammars._grammars.get(rid)
            if init.sampling.constraint is not None and live is not None and live.is_terminated():
                grammars.start(rid, init.sampling, init.token_ids, init.prompt_len)


def decode_table(
    runner: ModelRunner, managers: dict[str, GrammarManager], args: argparse.Namespace
) -> list[dict[str, Any]]:
    free = SamplingParams(temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, json_schema=json.dumps(DECODE_SCHEMA))
    rows = []
    timed = Timed(runner)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        decoder = Decoder(runner, b, args.context_len, args.decode_steps)
        decoder.timed = timed
        for name, manager in managers.items():
            timed.attach(manager)
            manager.compile("json_schema", constrained.json_schema or "").result()
            best = {"free": 0.0, "constrained": 0.0}
            parts: dict[str, list[float]] = {
                "free_sample": [],
                "sample": [],
                "fill": [],
                "accept": [],
            }
            for _ in range(args.repeats):
                runner.grammars = manager
                best["free"] = max(best["free"], decoder.run(free))
                parts["free_sample"].append(timed.spent["sample"])
                best["constrained"] = max(best["constrained"], decoder.run(constrained))
                for key in ("sample", "fill", "accept"):
                    parts[key].append(timed.spent[key])
            row = {
                "batch": b,
                "backend": name,
                "free_tok_s": best["free"],
                "constrained_tok_s": best["constrained"],
                "ms_per_step": {k: 1e3 * min(v) / args.decode_steps for k, v in parts.items()},
            }
            rows.append(row)
            print(
                f"decode b={b} {name}: free {best['free']:.1f}, constrained {best['constrained']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def compile_table(managers: dict[str, GrammarManager], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for schema_name, schema in COMPILE_SCHEMAS.items():
        text = json.dumps(schema)
        row: dict[str, Any] = {"schema": schema_name}
        for name, manager in managers.items():
            t0 = time.perf_counter()
            compiled = manager.compile("json_schema", text).result()
            cold = time.perf_counter() - t0
            if compiled.grammar is None:  # this backend cannot: said in the table
                row[name] = {"error": compiled.error}
                continue
            cached = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                again = manager.compile("json_schema", text).result()
                assert again.grammar is not None
                again.grammar.copy()  # what a request gets
                cached.append(time.perf_counter() - t0)
            row[name] = {
                "cold_ms": cold * 1e3,
                "cached_ms": statistics.median(cached) * 1e3,
                "backend": compiled.backend,
            }
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    path = model_path(ModelConfig(path=args.model))
    max_b = max(int(x) for x in args.batch_sizes.split(","))
    pages = max_b * (-(-(args.context_len + args.decode_steps + 2) // 16) + 1) + 1
    runner = ModelRunner(ModelConfig(path=str(path), num_threads=args.threads, num_pages=pages))
    tok = load_tokenizer(str(path))
    context = GrammarContext(
        tokenizer=tok.hf,
        vocab_size=runner.info.vocab_size,
        eos_token_ids=tuple(sorted(tok.eos_token_ids)),
    )
    managers = {
        name: GrammarManager(
            GrammarConfig(grammar_backend=name, grammar_fallback="none"),
            lambda: GrammarSetup(context),
        )
        for name in args.backends.split(",")
    }
    for manager in managers.values():
        manager.prepare().result()
    results: dict[str, Any] = {
        "model": str(path),
        "threads": torch.get_num_threads(),
        "machine": machine(),
        "args": vars(args),
    }
    results["compile"] = compile_table(managers, args.compile_repeats)
    results["decode"] = decode_table(runner, managers, args)

    lines = [
        "| decode | backend | free tok/s | JSON-schema tok/s | constrained / free "
        "| sampler ms/step, free → JSON | mask fill ms/step (beside the forward) | accept ms/step |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["decode"]:
        ratio = r["constrained_tok_s"] / r["free_tok_s"]
        ms = r["ms_per_step"]
        lines.append(
            f"| b={r['batch']} | {r['backend']} | {r['free_tok_s']:.1f} | {r['constrained_tok_s']:.1f} "
            f"| {ratio:.3f} | {ms['free_sample']:.2f} → {ms['sample']:.2f} | {ms['fill']:.2f} "
            f"| {ms['accept']:.2f} |"
        )
    names = list(managers)
    lines += ["", "| schema | " + " | ".join(f"{n} cold ms | {n} cached ms" for n in names) + " |"]
    lines.append("| --- |" + " ---: | ---: |" * len(names))
    for r in results["compile"]:
        cells = [
            f"{r[n]['cold_ms']:.1f} | {r[n]['cached_ms']:.3f}"
            if "error" not in r[n]
            else "n/a | n/a"
            for n in names
        ]
        lines.append(f"| {r['schema']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    for r in results["compile"]:
        for n in names:
            if "error" in r[n]:
                print(f"n/a: {n} on {r['schema']}: {r[n]['error']}")
    print(f"\nCPU: {results['machine'].get('cpu_model')}; torch threads {results['threads']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"raw results: {out}")
    for manager in managers.values():
        manager.close()


if __name__ == "__main__":
    main()
