"""Real networks' parameter tensors, for replaying one training step's gradient
synchronization (``lpsync bench --model NAME``). Nothing is downloaded: the shapes are
derived here from the published architectures, in the order the reference
implementations define (and register) their parameters, which is the order DDP buckets by.

Sources (the architecture definitions the lists follow; the totals are the published
parameter counts, checked by the tests):
- alexnet: torchvision.models.alexnet (torchvision/models/alexnet.py), 61,100,840;
- vgg16: torchvision.models.vgg16, configuration "D" without batch norm
  (torchvision/models/vgg.py), 138,357,544;
- resnet50: torchvision.models.resnet50, Bottleneck blocks [3, 4, 6, 3]
  (torchvision/models/resnet.py), 25,557,032;
- bert-base: Hugging Face transformers BertModel with bert-base-uncased's configuration
  (vocab 30522, hidden 768, 12 layers, intermediate 3072, 512 positions;
  transformers/models/bert/modeling_bert.py), 109,482,240;
- gpt2: Hugging Face transformers GPT2Model with gpt2's configuration (vocab 50257,
  1024 positions, 768 wide, 12 layers; transformers/models/gpt2/modeling_gpt2.py),
  124,439,808 (the LM head shares wte's weight).
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

from lpsync.errors import InvalidArgumentError

Tensor = tuple[str, tuple[int, ...]]  # (parameter name, shape)

# DDP's defaults (torch.nn.parallel.DistributedDataParallel): bucket_cap_mb=25 and a first
# bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so the first allreduce starts early.
BUCKET_BYTES = 25 << 20
FIRST_BUCKET_BYTES = 1 << 20


def _conv(name: str, cin: int, cout: int, k: int, bias: bool = True) -> list[Tensor]:
    return [(f"{name}.weight", (cout, cin, k, k))] + ([(f"{name}.bias", (cout,))] if bias else [])


def _linear(name: str, fan_in: int, fan_out: int) -> list[Tensor]:
    return [(f"{name}.weight", (fan_out, fan_in)), (f"{name}.bias", (fan_out,))]


def _norm(name: str, width: int) -> list[Tensor]:
    return [(f"{name}.weight", (width,)), (f"{name}.bias", (width,))]


def alexnet() -> list[Tensor]:
    t: list[Tensor] = []
    for i, (cin, cout, k) in zip(
        (0, 3, 6, 8, 10),
        ((3, 64, 11), (64, 192, 5), (192, 384, 3), (384, 256, 3), (256, 256, 3)),
        strict=True,
    ):
        t += _conv(f"features.{i}", cin, cout, k)
    return (
        t
        + _linear("classifier.1", 256 * 6 * 6, 4096)
        + _linear("classifier.4", 4096, 4096)
        + _linear("classifier.6", 4096, 1000)
    )


def vgg16() -> list[Tensor]:
    t: list[Tensor] = []
    cin, index = 3, 0
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            index += 1
            continue
        t += _conv(f"features.{index}", cin, int(v), 3)
        cin, index = int(v), index + 2  # conv, relu
    return (
        t
        + _linear("classifier.0", 512 * 7 * 7, 4096)
        + _linear("classifier.3", 4096, 4096)
        + _linear("classifier.6", 4096, 1000)
    )


def resnet50() -> list[Tensor]:
    t = _conv("conv1", 3, 64, 7, bias=False) + _norm("bn1", 64)
    cin = 64
    for layer, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512)), 1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            t += _conv(f"{p}.conv1", cin, width, 1, False) + _norm(f"{p}.bn1", width)
            t += _conv(f"{p}.conv2", width, width, 3, False) + _norm(f"{p}.bn2", width)
            t += _conv(f"{p}.conv3", width, 4 * width, 1, False) + _norm(f"{p}.bn3", 4 * width)
            if b == 0:
                t += _conv(f"{p}.downsample.0", cin, 4 * width, 1, False) + _norm(
                    f"{p}.downsample.1", 4 * width
                )
            cin = 4 * width
    return t + _linear("fc", 2048, 1000)


def bert_base() -> list[Tensor]:
    h, ff = 768, 3072
    t: list[Tensor] = [
        ("embeddings.word_embeddings.weight", (30522, h)),
        ("embeddings.position_embeddings.weight", (512, h)),
        ("embeddings.token_type_embeddings.weight", (2, h)),
    ]
    t += _norm("embeddings.LayerNorm", h)
    for i in range(12):
        p = f"encoder.layer.{i}"
        for part in ("query", "key", "value"):
            t += _linear(f"{p}.attention.self.{part}", h, h)
        t += _linear(f"{p}.attention.output.dense", h, h) + _norm(f"{p}.attention.output.LayerNorm", h)
        t += _linear(f"{p}.intermediate.dense", h, ff)
        t += _linear(f"{p}.output.dense", ff, h) + _norm(f"{p}.output.LayerNorm", h)
    return t + _linear("pooler.dense", h, h)


def gpt2() -> list[Tensor]:
    h = 768
    t: list[Tensor] = [("wte.weight", (50257, h)), ("wpe.weight", (1024, h))]
    for i in range(12):
        p = f"h.{i}"
        t += _norm(f"{p}.ln_1", h)
        # GPT-2's Conv1D stores weight as (in, out)
        t += [
            (f"{p}.attn.c_attn.weight", (h, 3 * h)),
            (f"{p}.attn.c_attn.bias", (3 * h,)),
            (f"{p}.attn.c_proj.weight", (h, h)),
            (f"{p}.attn.c_proj.bias", (h,)),
        ]
        t += _norm(f"{p}.ln_2", h)
        t += [
            (f"{p}.mlp.c_fc.weight", (h, 4 * h)),
            (f"{p}.mlp.c_fc.bias", (4 * h,)),
            (f"{p}.mlp.c_proj.weight", (4 * h, h)),
            (f"{p}.mlp.c_proj.bias", (h,)),
        ]
    return t + _norm("ln_f", h)


MODELS: dict[str, Callable[[], list[Tensor]]] = {
    "alexnet": alexnet,
    "vgg16": vgg16,
    "resnet50": resnet50,
    "bert-base": bert_base,
    "gpt2": gpt2,
}


def tensors(model: str) -> list[Tensor]:
    try:
        return MODELS[model]()
    except KeyError:
        raise InvalidArgumentError(f"--model {model!r}: expected one of {', '.join(MODELS)}") from None


def sizes(model: str) -> list[int]:
    """Element counts of the model's parameters, in definition order."""
    return [prod(shape) for _, shape in tensors(model)]


def ddp_buckets(
    counts: list[int],
    itemsize: int = 4,
    bucket_bytes: int = BUCKET_BYTES,
    first_bytes: int = FIRST_BUCKET_BYTES,
) -> list[int]:
    """Element counts of the buckets DDP forms: parameters in reverse definition order
    (gradients arrive roughly so), a bucket closed once it holds at least its cap (the
    first bucket's cap is ``first_bytes``), in the order DDP allreduces them."""
    buckets: list[int] = []
    current, cap = 0, first_bytes
    for n in reversed(counts):
        current += n
        if current * itemsize >= cap:
            buckets.append(current)
            current, cap = 0, bucket_bytes
    if current:
        buckets.append(current)
    return buckets
