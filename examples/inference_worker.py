"""An inference worker that follows weightsvc: it keeps sampling while it swaps each new version in.

    python examples/inference_worker.py --target 127.0.0.1:50051 --model policy

The sampler thread runs the policy, step after step, on the active copy of the weights. The loader
thread watches weightsvc; for each new version it pulls only what changed since the version it
holds (a delta pull), writes it into the spare copy while the sampler keeps going, swaps the two
copies between two sampling steps, and acks the version once it has sampled with it, so that the
service sees the fleet move.
Each swap prints one JSON line on stdout.

With `--vllm CHECKPOINT_DIR` the worker runs a real vLLM engine started from that checkpoint
instead of the toy policy: sampling and updates take turns (vLLM reloads its weights in place,
between two generations), and `weightsvc.loaders.update_vllm` pulls, checks, loads and acks each
version (each tensor-parallel worker pulls only its slice); a swap is printed once the version has served a
batch.

    python examples/inference_worker.py --target 127.0.0.1:50051 --model policy --vllm ./my-model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch
import xxhash

from weightsvc.client import InferenceClient
from weightsvc.loaders import load_into

VOCAB, DIM, CONTEXT = 256, 64, 8


class Policy(torch.nn.Module):
    """A tiny language model: embeddings, one MLP block, an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(dim=-2)
        return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Digest of the bits of a set of tensors, by name: equal only if every bit is."""
    h = xxhash.xxh3_64()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DoubleBuffer:
    """Two copies of the policy: the sampler reads the active one while the loader writes the spare.

    A swap only flips which copy is active. The loader waits before writing a copy only while a
    sampling step that began before the previous swap still reads it: sampling never waits."""

    def __init__(self, make: Callable[[], torch.nn.Module]) -> None:
        self.copies = [make(), make()]
        self.active = 0
        self.version: int | None = None
        self._readers = [0, 0]
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def reading(self) -> Iterator[tuple[torch.nn.Module, int | None]]:
        with self._changed:
            i, version = self.active, self.version
            self._readers[i] += 1
        try:
            yield self.copies[i], version
        finally:
            with self._changed:
                self._readers[i] -= 1
                self._changed.notify_all()

    def load(self, served: Mapping[str, torch.Tensor], version: int) -> None:
        spare = 1 - self.active
        with self._changed:
            self._changed.wait_for(lambda: self._readers[spare] == 0)
        load_into(self.copies[spare], served)  # outside the lock: the sampler keeps going
        with self._changed:
            self.active, self.version = spare, version


class Sampler(threading.Thread):
    def __init__(self, weights: DoubleBuffer) -> None:
        super().__init__(name="sampler", daemon=True)
        self.weights = weights
        self.steps: Counter[int | None] = Counter()  # sampling steps run with each version
        self.stop = threading.Event()
        self._stepped = threading.Condition()

    def run(self) -> None:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (4, CONTEXT), generator=gen)
        with torch.inference_mode():
            while not self.stop.is_set():
                with self.weights.reading() as (policy, version):
                    logits = policy(tokens).float()
                next_token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                tokens = torch.cat([tokens[:, 1:], next_token], dim=1)
                with self._stepped:
                    self.steps[version] += 1
                    self._stepped.notify_all()

    def wait_sampled(self, version: int, timeout: float = 60.0) -> bool:
        """Wait until a sampling step has run with `version`: from then on the worker serves it."""
        with self._stepped:
            return self._stepped.wait_for(lambda: self.steps[version] > 0, timeout)

    @property
    def total(self) -> int:
        return sum(self.steps.values())


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def follow(target: str, model: str, until_version: int | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    weights = DoubleBuffer(lambda: Policy().to(dtype).eval())
    sampler = Sampler(weights)  # starts once the first version is loaded
    client_id = f"{socket.gethostname()}-worker"
    with InferenceClient(target) as client:
        for info in client.watch(model):  # reconnects with backoff if the service restarts
            if weights.version is not None and info.version <= weights.version:
                continue
            before = sampler.total
            # A delta against the version this client pulled last (dense when that is not smaller).
            served = client.pull(model, info.version, base=weights.version)
            weights.load(served, info.version)
            if not sampler.is_alive():
                sampler.start()
            sampler.wait_sampled(info.version)  # acked once it is what the worker samples with
            client.ack(model, info.version, client_id)
            emit(event="swap", version=info.version, sampled_during_load=sampler.total - before,
                 pulled_bytes=client.last_pull_bytes)
            if until_version is not None and info.version >= until_version:
                break
    sampler.stop.set()
    if sampler.is_alive():
        sampler.join()
    with weights.reading() as (policy, version):
        digest = weights_digest(policy.state_dict())
    emit(event="done", version=version, steps={str(v): n for v, n in sampler.steps.items()}, digest=digest)


PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 7], [1, 300, 301, 302, 450, 12, 77]]  # token ids


def follow_vllm(target: str, model: str, checkpoint: str, until_version: int | None = None) -> None:
    from vllm import LLM, SamplingParams

    from weightsvc.loaders import update_vllm

    # Eager mode: no graph capture at start-up (a quicker start for a demo; drop it in production).
    llm = LLM(model=checkpoint, worker_extension_cls="weightsvc.loaders.VllmWorkerExtension", enforce_eager=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    turn = threading.Lock()  # one of sampling or loading at a time
    state: dict[str, int | None] = {"version": None}
    steps: Counter[int | None] = Counter()
    stop = threading.Event()
    sampled = threading.Condition()  # a batch was sampled (on the version `steps` counts it under)

    def sample() -> None:
        sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
        while not stop.is_set():
            with turn:
                llm.generate(prompts, sampling, use_tqdm=False)
                with sampled:
                    steps[state["version"]] += 1
                    sampled.notify_all()

    sampler = threading.Thread(target=sample, name="sampler", daemon=True)
    client_id = f"{socket.gethostname()}-vllm"
    with InferenceClient(target) as client:
        for info in client.watch(model):
            if state["version"] is not None and info.version <= state["version"]:
                continue
            with turn:
                update_vllm(llm, target, model, info.version, client_id=client_id)  # acked once loaded
                state["version"] = info.version
            if not sampler.is_alive():
                sampler.start()
            with sampled:  # a swap is announced once the version has served a batch
                sampled.wait_for(lambda v=info.version: steps[v] > 0)
            emit(event="swap", version=info.version)
            if until_version is not None and info.version >= until_version:
                break
    stop.set()
    if sampler.is_alive():
        sampler.join()
    with turn:
        out = llm.generate(prompts, greedy, use_tqdm=False)
    emit(event="done", version=state["version"], tokens=sum(steps.values()),
         generations=[list(o.outputs[0].token_ids) for o in out])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="weightsvc gRPC HOST:PORT")
    parser.add_argument("--model", default="default")
    parser.add_argument("--until-version", type=int, help="exit once this version is loaded")
    parser.add_argument("--vllm", metavar="CHECKPOINT_DIR", help="run a vLLM engine started from this checkpoint")
    args = parser.parse_args()
    if args.vllm:
        follow_vllm(args.target, args.model, args.vllm, args.until_version)
    else:
        follow(args.target, args.model, args.until_version)


if __name__ == "__main__":
    main()
