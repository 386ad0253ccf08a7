"""Weight sync of a Qwen2.5-0.5B-shaped policy (bf16, 1.26 GB as synced) on a GPU machine.

    python benchmarks/gpu_sync.py [--repeats 5]              # part of benchmarks/gpu_smoke.sh
    python benchmarks/gpu_sync.py --save-model DIR           # write the model folder, exit

The model is built here (random weights of Qwen2.5-0.5B's shape: 24 layers, hidden 896,
14 heads / 2 KV heads, MLP 4864, vocab 151936, tied embeddings) with ludic's tiny tokenizer;
nothing is downloaded. This process is the trainer. Measured, each the median of
``--repeats`` syncs of the whole model, as seconds and as a ratio to (a) in the same run:

  (a) floor:    one device-to-device copy of every weight on this GPU (what a colocated
                 receiver's load costs at least);
  (b) packed_cuda_ipc: ludic's sender -> a receiver process on the same GPU opening one
                 IPC handle per chunk and copying into its own model-shaped buffers;
  (c) cuda_ipc:  the same with one handle per tensor;
  (d) nccl:      broadcast to a receiver process on GPU 1 (needs two GPUs: NCCL refuses two
                 ranks on one GPU);
  (e) vllm:      ``VLLMChatClient.sync_weights`` into a real vLLM server on this GPU through
                 packed CUDA IPC, end to end (HTTP announcements, load, version bump; needs
                 vLLM installed).

The goal for a 0.5B model in bf16 is <= 0.1 s per sync. Rows that cannot run say why.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


def build_model(device: str = "cuda") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ludic.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        **QWEN25_05B,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def save_model(path: Path) -> Path:
    """The 0.5B-shaped model and the tiny tokenizer as an HF folder (for vLLM, the recipe)."""
    from ludic.models.tiny import build_tiny_tokenizer

    model = build_model("cpu")
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: layouts, handles, allocator
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ------------------------------------------------------------------------------ IPC / NCCL
class QueueControlPlane:
    """Announcements to one receiver process over a queue; its acknowledgements back."""

    def __init__(self, requests: mp.Queue, results: mp.Queue) -> None:
        self.requests, self.results, self.pending = requests, results, 0

    def announce(self, request) -> None:
        self.requests.put(json.dumps(request.to_dict()))
        self.pending += 1

    def wait_until_applied(self, timeout_s: float) -> None:
        for _ in range(self.pending):
            status, detail = self.results.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(detail)
        self.pending = 0


def receiver_main(strategy_name: str, info: dict, device: int, requests, results) -> None:
    """Receive every announced chunk and copy it into model-shaped buffers (a loader)."""
    from ludic.distributed.weight_transfer import create_strategy, sync_info_from_dict

    torch.cuda.set_device(device)
    buffers = {n: torch.empty_like(t, device="cuda") for n, t in build_model().state_dict().items()}
    kwargs = {"backend": "nccl", "timeout_s": 120.0} if strategy_name == "broadcast" else {}
    strategy = create_strategy(strategy_name, **kwargs)
    rank = {"rank": 1} if strategy_name == "broadcast" else {}
    receiver = strategy.create_receiver(sync_info_from_dict(info), **rank)
    results.put(("ok", "ready"))
    while (data := requests.get()) is not None:
        try:
            named = receiver.receive(receiver.parse_request(json.loads(data)))
            for name, tensor in named.items():
                buffers[name].copy_(tensor)
            torch.cuda.current_stream().synchronize()
            results.put(("ok", len(named)))
        except Exception as e:  # reported to the trainer, which raises
            results.put(("error", f"{type(e).__name__}: {e}"))


def transfer_time(strategy_name: str, state: dict, repeats: int) -> float:
    from ludic.distributed.weight_transfer import ModelWeightExtractor, create_strategy, free_port

    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    nccl = strategy_name == "broadcast"
    strategy = create_strategy(strategy_name, **({"backend": "nccl"} if nccl else {}))
    info = strategy.create_sync_info(master_addr="127.0.0.1", master_port=free_port(), world_size=2)
    device = 1 if nccl else 0
    proc = ctx.Process(
        target=receiver_main, args=(strategy_name, info.to_dict(), device, requests, results)
    )
    proc.start()
    try:
        sender = strategy.create_sender(info)
        assert results.get(timeout=300) == ("ok", "ready")
        control = QueueControlPlane(requests, results)
        extractor = ModelWeightExtractor()

        def sync() -> None:
            sender.send(extractor.extract_state_dict(state), control, version=None)
            control.wait_until_applied(120.0)

        return median_time(sync, repeats)
    finally:
        requests.put(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------------------------ vLLM
def vllm_time(state: dict, repeats: int) -> float:
    from ludic.distributed.weight_transfer import create_strategy
    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.process import start_vllm_server

    folder = save_model(Path(tempfile.mkdtemp(prefix="ludic_gpu_sync_")) / "model")
    extra = ["--gpu-memory-utilization", "0.3", "--enable-sleep-mode", "--max-model-len", "2048"]
    with start_vllm_server(folder, api_key="gpu-sync", extra_args=extra) as server:
        client = VLLMChatClient(server.url, api_key="gpu-sync", timeout_s=120.0)
        try:
            client.init_weight_sync(strategy=create_strategy("packed_cuda_ipc"))
            version = iter(range(1, 10_000))
            return median_time(lambda: client.sync_weights(state, version=next(version)), repeats)
        finally:
            client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save-model", type=Path, help="write the model folder there and exit")
    args = parser.parse_args()
    if args.save_model:
        print(f"saved {save_model(args.save_model)}")
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_sync.py needs a CUDA GPU")
    model = build_model()
    state = {n: t.detach() for n, t in model.state_dict().items()}
    gigabytes = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    print(f"{torch.cuda.get_device_name()}: Qwen2.5-0.5B shape, bf16, {gigabytes:.3f} GB")
    copies = {n: torch.empty_like(t) for n, t in state.items()}

    def floor() -> None:
        for name, tensor in state.items():
            copies[name].copy_(tensor)

    rows: dict[str, float | str] = {"(a) floor: device copy": median_time(floor, args.repeats)}
    for label, name in (("(b) packed_cuda_ipc", "packed_cuda_ipc"), ("(c) cuda_ipc", "cuda_ipc")):
        rows[label] = transfer_time(name, state, args.repeats)
    if torch.cuda.device_count() >= 2:
        rows["(d) nccl to GPU 1"] = transfer_time("broadcast", state, args.repeats)
    else:
        rows["(d) nccl to GPU 1"] = "skipped: one GPU (NCCL refuses two ranks on one GPU)"
    try:
        import vllm  # noqa: F401
    except ImportError:
        rows["(e) vllm server, packed_cuda_ipc"] = "skipped: vLLM is not installed here"
    else:
        rows["(e) vllm server, packed_cuda_ipc"] = vllm_time(state, args.repeats)
    base = rows["(a) floor: device copy"]
    assert isinstance(base, float)
    for label, value in rows.items():
        if isinstance(value, float):
            goal = (
                ""
                if label.startswith("(a)")
                else f"  goal <= 0.1 s: {'met' if value <= 0.1 else 'NOT met'}"
            )
            print(f"{label:36s} {value:8.4f} s  {value / base:7.1f}x floor{goal}")
        else:
            print(f"{label:36s} {value}")


if __name__ == "__main__":
    main()
