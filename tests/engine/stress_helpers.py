"""Randomized AsyncEngine stress scenario: generator, runner and checker (not a test module).

Shared by tests/engine/test_async_stress.py (short settings, CI) and benchmarks/async_stress.py
(long settings). A scenario is a list of StreamSpec drawn from one seed: prompts (slices of the
benchmark prompts, many sharing prefixes), sampling (greedy, seeded, unseeded), a client
behaviour (consume, break, cancel, abort, ...), an arrival time and, for some streams, the id of an
earlier stream to reuse once that stream's task is done. `run_scenario` drives all of them against
one AsyncEngine (a tiny KV pool forces preemption), then checks:

- every stream ends exactly once: at most one delta has finish_reason, and it is the last; a
  stream read to the end has one; nothing hangs (one timeout over the whole run);
- greedy and seeded streams that ran to completion equal their "alone" run (token ids, text and
  finish reason) from a synchronous LLM of the same config; a stream that was aborted, broken off
  or cancelled streamed a prefix of it;
- max_tokens, EOS, stop token ids and stop strings are exact, ids are in the vocabulary, deltas
  carry the stream's own id and none but the last is empty;
- id reuse after the earlier stream's task is done always succeeds;
- the engine preempted, the KV pool is whole afterwards, and a fresh request is still served right.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field

from asyncspec import SamplingParams
from asyncspec.outputs import RequestOutput
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import BUNDLED_VOCAB, bundled_llm, wait_kv_free

ENGINE_CONFIG = dict(
    device="cpu",
    dtype="float32",
    block_size=16,
    max_model_len=160,
    # Prompts of 8..64 tokens plus up to 24 new ones need at most 6 blocks alone; a dozen
    # concurrent streams need far more than 12, so running requests get preempted.
    num_kv_blocks=12,
    max_num_batched_tokens=64,
    max_num_seqs=12,
    enable_prefix_caching=True,
)

KINDS = {"greedy": 0.4, "seeded": 0.35, "unseeded": 0.25}
BEHAVIOURS = {
    "consume": 0.33,  # read to the end
    "break": 0.12,  # `async with aclosing(...)`, break after n deltas
    "break_gc": 0.07,  # plain `async for ...: break`: the loop's asyncgen hook closes the stream later
    "cancel": 0.16,  # task.cancel() after a delay (0: before the task ever ran)
    "abort": 0.16,  # await engine.abort(id) after n deltas, then read to the end
    "abort_timer": 0.16,  # another task calls engine.abort(id) after a delay; read to the end
}
NO_REUSE_TARGET = {"break_gc"}
"""A plain `break` leaves the stream open until the generator is garbage collected, so the
engine cannot know that client left when its task is done: its id is not reused."""
COMPARED_KINDS = ("greedy", "seeded")
STOP_TOKEN_IDS = (9, 10, 13, 15)  # "(", ")", ",", "." : frequent in the bundled model's Python
STOP_STRINGS = ("(", "):", " = ", "\n\n", "self.")
TERMINAL = ("length", "stop")

ParamsKey = tuple[tuple[str, object], ...]
RefKey = tuple[tuple[int, ...], ParamsKey]


@dataclass
class ScenarioConfig:
    seed: int
    num_streams: int = 40
    mean_arrival_gap: float = 0.02
    """Mean gap between arrivals in seconds (exponential); with burst_prob a stream arrives with
    the previous one."""
    burst_prob: float = 0.25
    prompt_len: tuple[int, int] = (8, 64)
    max_tokens: tuple[int, int] = (1, 24)
    reuse_fraction: float = 0.2
    """About this fraction of streams reuse the id of an earlier one."""
    max_cancel_delay: float = 0.3
    max_abort_delay: float = 0.25
    num_base_prompts: int = 6
    opening_burst: int = 4
    """The first streams arrive together, long (prompts of 48..64 tokens, 20..24 new tokens, ignore_eos)
    and read to the end: together they need about twice the pool, so every run preempts (at least 3
    times in each of 40+ seeds tried)."""
    stop_prob: float = 0.25
    """Probability of stop_token_ids, and (independently) of a stop string, per stream."""
    timeout: float = 60.0
    """Whole-run timeout: a stream still open after it counts as hung."""
    num_alone_checks: int = 3
    """Reference keys also run one request at a time (checks the batched references)."""
    id_prefix: str = ""


@dataclass
class StreamSpec:
    index: int
    request_id: str
    prompt: list[int]
    params_kwargs: ParamsKey
    kind: str
    behaviour: str
    n: int
    """Deltas before break / abort."""
    delay: float | str
    """Cancel: "now" (before the task ran), "yield" (after one loop turn) or seconds; abort_timer: seconds."""
    arrival: float
    reuses: int | None = None
    """Index of the earlier stream whose id this one reuses (it starts once that task is done)."""
    reuse_gap: float | str = 0.0
    """Extra wait after that task is done: 0.0 (none at all), "yield" or seconds."""

    def params(self) -> SamplingParams:
        return make_params(self.params_kwargs)

    @property
    def max_tokens(self) -> int:
        return dict(self.params_kwargs)["max_tokens"]

    @property
    def ignore_eos(self) -> bool:
        return dict(self.params_kwargs)["ignore_eos"]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return dict(self.params_kwargs).get("stop_token_ids", ())

    @property
    def stop(self) -> tuple[str, ...]:
        return dict(self.params_kwargs).get("stop", ())

    @property
    def ref_key(self) -> RefKey:
        return tuple(self.prompt), self.params_kwargs

    def describe(self) -> str:
        extra = f" reuses #{self.reuses} gap={self.reuse_gap}" if self.reuses is not None else ""
        return (
            f"#{self.index} id={self.request_id!r} {self.kind}/{self.behaviour} n={self.n} delay={self.delay} "
            f"prompt_len={len(self.prompt)} {dict(self.params_kwargs)}{extra}"
        )


@dataclass
class StreamResult:
    spec: StreamSpec
    deltas: list[RequestOutput] = field(default_factory=list)
    broke: bool = False
    cancelled: bool = False
    abort_sent: bool = False
    error: BaseException | None = None
    t_submit: float | None = None
    t_first: float | None = None
    t_end: float | None = None

    def add(self, delta: RequestOutput) -> None:
        if self.t_first is None:
            self.t_first = time.monotonic()
        self.deltas.append(delta)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def finish_reason(self) -> str | None:
        return self.deltas[-1].finish_reason if self.deltas else None

    @property
    def outcome(self) -> str:
        if self.error is not None:
            return "error"
        if self.finish_reason is not None:
            return self.finish_reason  # length / stop / abort
        if self.cancelled:
            return "cancelled"
        if self.broke:
            return "broke"
        return "incomplete"  # the stream ended without a final delta (or never ran)


def make_params(kwargs: ParamsKey) -> SamplingParams:
    return SamplingParams(**{k: list(v) if isinstance(v, tuple) else v for k, v in kwargs})


# -- scenario ------------------------------------------------------------------------------
def _pick(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def make_prompts_pool(cfg: ScenarioConfig) -> list[list[int]]:
    return load_prompts(max(cfg.num_base_prompts, 2))


def _make_prompt(rng: random.Random, bases: list[list[int]], cfg: ScenarioConfig, long: bool = False) -> list[int]:
    lo, hi = cfg.prompt_len
    if long:
        lo = max(lo, hi - 16)
    length = rng.choice([16, 32, 48, 64]) if rng.random() < 0.25 else rng.randint(lo, hi)
    length = max(lo, min(hi, length))
    hot = bases[: max(1, len(bases) // 2)]  # most prompts start like one of a few: shared prefixes
    r = rng.random()
    if r < 0.6:  # a prefix of a hot prompt (duplicates and prefix-cache hits, whole blocks or not)
        return list(rng.choice(hot)[:length])
    if r < 0.85:  # a hot prompt's first 16 / 32 tokens, then another prompt's tokens
        shared = rng.choice([16, 32])
        if shared >= length:
            return list(rng.choice(hot)[:length])
        return list(rng.choice(hot)[:shared]) + list(rng.choice(bases)[shared:length])
    base = rng.choice(bases)  # a slice from the middle: no shared prefix
    start = rng.randint(0, len(base) - length)
    return list(base[start : start + length])


def _make_params(rng: random.Random, kind: str, cfg: ScenarioConfig, long: bool = False) -> ParamsKey:
    lo, hi = cfg.max_tokens
    kw: dict[str, object] = dict(
        max_tokens=rng.randint(max(lo, hi - 4), hi) if long else rng.randint(lo, hi),
        ignore_eos=long or rng.random() < 0.5,
    )
    if not long and rng.random() < cfg.stop_prob:
        kw["stop_token_ids"] = [rng.choice(STOP_TOKEN_IDS)]
    if not long and rng.random() < cfg.stop_prob:
        kw["stop"] = [rng.choice(STOP_STRINGS)]
        kw["include_stop_str_in_output"] = rng.random() < 0.5
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.7, 0.8, 1.0])
        kw["top_p"] = rng.choice([1.0, 1.0, 0.9, 0.95])
        kw["top_k"] = rng.choice([0, 0, 20, 50])
        if kind == "seeded":
            kw["seed"] = rng.choice([rng.randrange(2**31), rng.randrange(-(2**63), 2**63)])
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kw.items()))


def make_scenario(cfg: ScenarioConfig, bases: list[list[int]] | None = None) -> list[StreamSpec]:
    rng = random.Random(cfg.seed)
    bases = bases if bases is not None else make_prompts_pool(cfg)
    specs: list[StreamSpec] = []
    reused: set[int] = set()
    t = 0.0
    for i in range(cfg.num_streams):
        if i and rng.random() >= cfg.burst_prob:
            t += rng.expovariate(1.0 / cfg.mean_arrival_gap)
        opening = i < cfg.opening_burst
        kind = rng.choice(COMPARED_KINDS) if opening else _pick(rng, KINDS)
        behaviour = "consume" if opening else _pick(rng, BEHAVIOURS)
        if behaviour == "cancel":
            delay: float | str = rng.choice(["now", "yield", *[round(rng.uniform(0, cfg.max_cancel_delay), 4)] * 3])
        elif behaviour == "abort_timer":
            delay = round(rng.uniform(0, cfg.max_abort_delay), 4)
        else:
            delay = 0.0
        spec = StreamSpec(
            index=i,
            request_id=f"{cfg.id_prefix}s{cfg.seed}-{i}",
            prompt=_make_prompt(rng, bases, cfg, long=opening),
            params_kwargs=_make_params(rng, kind, cfg, long=opening),
            kind=kind,
            behaviour=behaviour,
            n=rng.randint(1, 4),
            delay=delay,
            arrival=round(t, 4),
        )
        candidates = [
            j for j in range(max(0, i - 12), i) if j not in reused and specs[j].behaviour not in NO_REUSE_TARGET
        ]
        if candidates and rng.random() < cfg.reuse_fraction:
            j = rng.choice(candidates)
            reused.add(j)
            spec.reuses = j
            spec.request_id = specs[j].request_id
            spec.reuse_gap = rng.choice([0.0, 0.0, "yield", round(rng.uniform(0, 0.05), 4)])
        specs.append(spec)
    return specs


# -- running -------------------------------------------------------------------------------
async def _pause(value: float | str) -> None:
    if value == "yield":
        await asyncio.sleep(0)
    elif value:
        await asyncio.sleep(float(value))


async def _abort_later(engine, request_id: str, delay: float, res: StreamResult) -> None:
    await asyncio.sleep(delay)
    if res.finish_reason is None:
        res.abort_sent = True
    await engine.abort(request_id)


async def _consume(engine, spec: StreamSpec, res: StreamResult) -> None:
    res.t_submit = time.monotonic()
    if spec.behaviour in ("break", "break_gc"):
        stream = engine.generate(spec.prompt, spec.params(), request_id=spec.request_id)
        # "break" closes the stream before this task is done; "break_gc" leaves that to the
        # event loop's asyncgen finalizer once the generator is unreferenced.
        closing = contextlib.aclosing(stream) if spec.behaviour == "break" else contextlib.nullcontext()
        async with closing:
            async for delta in stream:
                res.add(delta)
                if len(res.deltas) >= spec.n and not delta.finished:
                    res.broke = True
                    break
        return
    timer = None
    if spec.behaviour == "abort_timer":
        timer = asyncio.create_task(_abort_later(engine, spec.request_id, float(spec.delay), res))
    try:
        async for delta in engine.generate(spec.prompt, spec.params(), request_id=spec.request_id):
            res.add(delta)
            if spec.behaviour == "abort" and len(res.deltas) == spec.n and not delta.finished:
                res.abort_sent = True
                await engine.abort(spec.request_id)
    finally:
        if timer is not None:
            # Before this stream's task is done: a late abort must not reach a later stream
            # that reuses the id.
            timer.cancel()
            await asyncio.wait({timer})


async def _stream_main(engine, spec: StreamSpec, res: StreamResult, previous: asyncio.Task | None, t0: float):
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + spec.arrival - loop.time()))
    if previous is not None:
        await asyncio.wait({previous})
        await _pause(spec.reuse_gap)
    consumer = asyncio.create_task(_consume(engine, spec, res))
    if spec.behaviour == "cancel":
        if spec.delay == "yield":
            await asyncio.sleep(0)
        elif spec.delay != "now":
            await asyncio.wait({consumer}, timeout=float(spec.delay))
        consumer.cancel()
    try:
        await consumer
    except asyncio.CancelledError:
        if not consumer.cancelled():
            raise  # this task itself was cancelled (hang cleanup)
        res.cancelled = True
    except Exception as e:  # recorded, and reported by check_stream
        res.error = e
    res.t_end = time.monotonic()


async def run_streams(engine, specs: list[StreamSpec], timeout: float) -> tuple[list[StreamResult], list[str]]:
    """Runs every stream; returns the results and the hung streams (as failure lines)."""
    results = [StreamResult(spec) for spec in specs]
    tasks: list[asyncio.Task] = []
    t0 = asyncio.get_running_loop().time()
    for spec, res in zip(specs, results, strict=True):
        previous = tasks[spec.reuses] if spec.reuses is not None else None
        tasks.append(asyncio.create_task(_stream_main(engine, spec, res, previous, t0)))
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    hung = []
    for task in pending:
        res = results[tasks.index(task)]
        hung.append(f"HUNG after {timeout}s: {res.spec.describe()} deltas={len(res.deltas)} outcome={res.outcome}")
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5.0)
    return results, hung


async def wait_engine_idle(engine, timeout: float = 20.0) -> dict | None:
    """The engine's stats once the pool is whole and nothing runs or waits; None on timeout (reported
    as a failure by the caller rather than raised)."""
    try:
        return await wait_kv_free(engine, timeout)
    except AssertionError:
        return None


# -- references ----------------------------------------------------------------------------
class References:
    """Alone runs of (prompt, params) on a synchronous LLM of the engine's config, cached."""

    def __init__(self, llm=None, **config) -> None:
        self.llm = llm if llm is not None else bundled_llm(**{**ENGINE_CONFIG, **config})
        self.cache: dict[RefKey, RequestOutput] = {}
        self.num_computed = 0

    def compute(self, keys) -> None:
        """Computes the missing keys as batches of max_num_seqs (seeded sampling is batch-invariant,
        which `check_alone` verifies on a few)."""
        missing = list(dict.fromkeys(k for k in keys if k not in self.cache))
        batch = self.llm.config.max_num_seqs
        for start in range(0, len(missing), batch):
            chunk = missing[start : start + batch]
            outs = self.llm.generate([list(p) for p, _ in chunk], [make_params(kw) for _, kw in chunk])
            self.cache.update(zip(chunk, outs, strict=True))
            self.num_computed += len(chunk)

    def get(self, key: RefKey) -> RequestOutput:
        if key not in self.cache:
            self.compute([key])
        return self.cache[key]

    def check_alone(self, keys, n: int, rng: random.Random) -> list[str]:
        """Runs n of the keys one request at a time and compares with the cached (batched) result."""
        keys = sorted(set(keys), key=repr)
        seeded = [k for k in keys if "seed" in dict(k[1])]
        chosen = rng.sample(seeded, min(len(seeded), (n + 1) // 2))
        rest = [k for k in keys if k not in chosen]
        chosen += rng.sample(rest, min(len(rest), n - len(chosen)))
        failures = []
        for key in chosen:
            alone = self.llm.generate([list(key[0])], make_params(key[1]))[0]
            batched = self.get(key)
            if (alone.token_ids, alone.text, alone.finish_reason) != (
                batched.token_ids,
                batched.text,
                batched.finish_reason,
            ):
                failures.append(
                    f"batched reference differs from the one-at-a-time run for {dict(key[1])} "
                    f"prompt_len={len(key[0])}: {batched.token_ids} vs {alone.token_ids}"
                )
        return failures


# -- checking ------------------------------------------------------------------------------
def _is_prefix(short: list, full: list) -> bool:
    return len(short) <= len(full) and full[: len(short)] == short


def check_stream(
    res: StreamResult,
    ref: RequestOutput | None,
    eos_ids,
    vocab: int = BUNDLED_VOCAB,
    previous: StreamResult | None = None,
) -> list[str]:
    """Failure lines of one stream (none: it passed); `previous` is the stream whose id it reused."""
    spec = res.spec
    where = spec.describe()
    fails: list[str] = []

    def fail(msg: str) -> None:
        fails.append(f"{msg} [{where}]")

    if res.error is not None:
        if spec.reuses is not None and "in use" in str(res.error):
            before = (
                f" (#{previous.spec.index} was {previous.spec.behaviour} -> {previous.outcome})" if previous else ""
            )
            fail(f"id reuse refused after the earlier stream's task was done{before}: {res.error!r}")
        else:
            fail(f"stream raised {res.error!r}")
        return fails
    deltas = res.deltas
    finished = [i for i, d in enumerate(deltas) if d.finished]
    if len(finished) > 1:
        fail(f"{len(finished)} deltas have finish_reason: {[deltas[i].finish_reason for i in finished]}")
    if finished and finished[0] != len(deltas) - 1:
        fail(f"delta(s) after the final one: final at {finished[0]} of {len(deltas)}")
    bad_ids = [d.request_id for d in deltas if d.request_id != spec.request_id]
    if bad_ids:
        fail(f"deltas of other requests: {bad_ids}")
    empty = [i for i, d in enumerate(deltas) if not d.finished and not d.token_ids and not d.text]
    if empty:
        fail(f"empty non-final deltas at {empty}")
    tokens = res.token_ids
    bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        fail(f"ids outside [0, {vocab}) reached the client: {bad}")
    if len(tokens) > spec.max_tokens:
        fail(f"{len(tokens)} tokens streamed, past max_tokens={spec.max_tokens}")
    outcome = res.outcome
    must_finish = spec.behaviour in ("consume", "abort", "abort_timer")
    if must_finish and outcome not in ("length", "stop", "abort"):
        fail(f"stream read to the end ended without a final delta (outcome {outcome})")
    if outcome == "abort" and not res.abort_sent:
        fail("finish_reason 'abort' but this stream was never aborted")
    if outcome == "abort" and len(tokens) >= spec.max_tokens:
        fail(f"aborted after all {len(tokens)} tokens: it should have finished with 'length'")
    if outcome == "length" and len(tokens) != spec.max_tokens:
        fail(f"finish_reason 'length' after {len(tokens)} of max_tokens={spec.max_tokens}")
    if outcome == "stop":
        stop_reason = deltas[-1].stop_reason
        last = tokens[-1] if tokens else None
        if isinstance(stop_reason, str):
            if stop_reason not in spec.stop:
                fail(f"stopped by the string {stop_reason!r}, not one of {spec.stop}")
            elif dict(spec.params_kwargs).get("include_stop_str_in_output"):
                if not res.text.endswith(stop_reason):
                    fail(f"include_stop_str_in_output, but the text {res.text!r} does not end with {stop_reason!r}")
            elif stop_reason in res.text:
                fail(f"the stop string {stop_reason!r} reached the client: {res.text!r}")
        elif not (last in spec.stop_token_ids or (not spec.ignore_eos and last in eos_ids)):
            fail(
                f"finish_reason 'stop' but the last token {last} is no stop id {spec.stop_token_ids} or EOS "
                f"{sorted(eos_ids)} (ignore_eos={spec.ignore_eos})"
            )
    elif spec.stop and outcome in TERMINAL and any(x in res.text for x in spec.stop):
        fail(f"the text contains a stop string {spec.stop} but the stream ended with {outcome}")
    if outcome in ("cancelled", "broke") and spec.behaviour not in ("cancel", "break", "break_gc"):
        fail(f"outcome {outcome} for a {spec.behaviour} stream")
    if ref is not None and spec.kind in COMPARED_KINDS:
        if outcome in TERMINAL:
            if tokens != ref.token_ids:
                fail(f"{spec.kind} output differs from its alone run: {tokens} vs {ref.token_ids}")
            elif res.text != ref.text:
                fail(f"text differs from its alone run: {res.text!r} vs {ref.text!r}")
            elif outcome != ref.finish_reason:
                fail(f"finish_reason {outcome} vs {ref.finish_reason} alone")
        elif not _is_prefix(tokens, ref.token_ids):
            fail(
                f"{spec.kind} partial output ({outcome}) is not a prefix of its alone run: {tokens} vs {ref.token_ids}"
            )
        elif outcome in ("cancelled", "broke") and not ref.text.startswith(res.text):
            fail(f"partial text ({outcome}) is not a prefix of the alone text: {res.text!r} vs {ref.text!r}")
    return fails


@dataclass
class Report:
    config: ScenarioConfig
    failures: list[str]
    summary: dict

    def failure_text(self, limit: int = 25) -> str:
        lines = self.failures[:limit]
        more = len(self.failures) - len(lines)
        return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))], 4)


@contextlib.contextmanager
def record_preemptions(engine):
    """Best effort (engine internals): yields a set that collects (request_id, prompt) of every
    preempted request, or None where the scheduler has no `_preempt` to wrap."""
    scheduler = getattr(getattr(getattr(engine, "engine", None), "engine_core", None), "scheduler", None)
    real = getattr(scheduler, "_preempt", None)
    if not callable(real):
        yield None
        return
    seen: set = set()

    def recording(request, *args, **kwargs):
        seen.add((request.request_id, tuple(request.prompt_token_ids)))
        return real(request, *args, **kwargs)

    scheduler._preempt = recording
    try:
        yield seen
    finally:
        del scheduler._preempt  # the instance attribute: back to the class's method


async def _drive(engine, specs: list[StreamSpec], cfg: ScenarioConfig, fresh: StreamSpec):
    before = dict(engine.stats())
    t0 = time.monotonic()
    with record_preemptions(engine) as preempted:
        results, hung = await run_streams(engine, specs, cfg.timeout)
    wall = time.monotonic() - t0
    failures = list(hung)
    idle = await wait_engine_idle(engine)
    after = dict(engine.stats())
    if idle is None:
        failures.append(f"KV pool not whole / requests left after every stream ended: {after}")
    # The engine still serves: a fresh greedy request, read to the end.
    fresh_res = StreamResult(fresh)
    try:
        await asyncio.wait_for(_consume(engine, fresh, fresh_res), 30.0)
    except Exception as e:  # reported as a failure below
        fresh_res.error = e
    if await wait_engine_idle(engine) is None:
        failures.append(f"KV pool not whole after the fresh request: {engine.stats()}")
    return results, failures, fresh_res, before, after, wall, preempted


def run_scenario(engine, refs: References, cfg: ScenarioConfig, bases: list[list[int]] | None = None) -> Report:
    """Generates, runs and checks one scenario; returns every failure (none: passed) and a summary.
    The engine must be idle before; it is idle after (unless a failure says otherwise)."""
    bases = bases if bases is not None else make_prompts_pool(cfg)
    specs = make_scenario(cfg, bases)
    fresh = StreamSpec(
        index=-1,
        request_id=f"{cfg.id_prefix}s{cfg.seed}-fresh",
        prompt=list(bases[0][:40]),
        params_kwargs=(("ignore_eos", True), ("max_tokens", 16), ("temperature", 0.0)),
        kind="greedy",
        behaviour="consume",
        n=1,
        delay=0.0,
        arrival=0.0,
    )
    results, failures, fresh_res, before, after, wall, preempted = asyncio.run(_drive(engine, specs, cfg, fresh))

    t_ref = time.monotonic()
    compared = [r for r in results if r.spec.kind in COMPARED_KINDS and r.error is None and r.deltas]
    refs.compute([r.spec.ref_key for r in compared] + [fresh.ref_key])
    eos_ids = engine.engine.eos_token_ids
    for res in results:
        ref = refs.get(res.spec.ref_key) if res in compared else None
        previous = results[res.spec.reuses] if res.spec.reuses is not None else None
        failures.extend(check_stream(res, ref, eos_ids, previous=previous))
    fresh_fails = check_stream(fresh_res, refs.get(fresh.ref_key), eos_ids)
    failures.extend(f"fresh request after the run: {f}" for f in fresh_fails)
    if fresh_res.outcome != "length":
        failures.append(f"fresh request after the run ended with {fresh_res.outcome}")
    failures.extend(refs.check_alone([r.spec.ref_key for r in compared], cfg.num_alone_checks, random.Random(cfg.seed)))
    ref_seconds = time.monotonic() - t_ref

    num_preemptions = after["num_preemptions"] - before["num_preemptions"]
    if num_preemptions <= 0:
        failures.append(f"no preemption happened: the KV pool is too large for this load ({after})")

    outcomes: dict[str, int] = {}
    behaviours: dict[str, dict[str, int]] = {}
    for res in results:
        outcomes[res.outcome] = outcomes.get(res.outcome, 0) + 1
        per = behaviours.setdefault(res.spec.behaviour, {})
        per[res.outcome] = per.get(res.outcome, 0) + 1
    ttft = [r.t_first - r.t_submit for r in results if r.t_first is not None and r.t_submit is not None]
    e2e = [r.t_end - r.t_submit for r in results if r.outcome in TERMINAL and r.t_end and r.t_submit]
    num_tokens = sum(len(r.token_ids) for r in results)
    summary = dict(
        seed=cfg.seed,
        num_streams=len(specs),
        wall_s=round(wall, 3),
        reference_s=round(ref_seconds, 3),
        num_failures=len(failures),
        outcomes=dict(sorted(outcomes.items())),
        behaviours={k: dict(sorted(v.items())) for k, v in sorted(behaviours.items())},
        kinds={k: sum(1 for s in specs if s.kind == k) for k in KINDS},
        num_id_reuses=sum(1 for s in specs if s.reuses is not None),
        num_compared_full=sum(1 for r in compared if r.outcome in TERMINAL),
        num_compared_prefix=sum(1 for r in compared if r.outcome not in TERMINAL),
        num_compared_full_after_preemption=None
        if preempted is None
        else sum(
            1 for r in compared if r.outcome in TERMINAL and (r.spec.request_id, tuple(r.spec.prompt)) in preempted
        ),
        num_streamed_tokens=num_tokens,
        streamed_tokens_per_s=round(num_tokens / wall, 1) if wall > 0 else None,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p95_s=_pct(ttft, 95),
        e2e_p50_s=_pct(e2e, 50),
        e2e_p95_s=_pct(e2e, 95),
        num_preemptions=num_preemptions,
        num_steps=after["num_steps"] - before["num_steps"],
        prefix_cache_hits=after["prefix_cache_hits"] - before["prefix_cache_hits"],
        prefix_cache_queries=after["prefix_cache_queries"] - before["prefix_cache_queries"],
        mean_deltas_per_stream=round(statistics.mean(len(r.deltas) for r in results), 2) if results else 0,
    )
    return Report(cfg, failures, summary)


def new_engine(**overrides):
    from asyncspec import AsyncEngine
    from asyncspec.config import make_config

    return AsyncEngine(make_config(str(TARGET_MODEL), **{**ENGINE_CONFIG, **overrides}))
