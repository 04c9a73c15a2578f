"""CalibrationConfig: every setting of transform learning, frozen, validated and serializable.

Defaults follow the paper's Table 7: sequences of 2048 tokens, batch 4, 128 training and 32 validation
sequences (disjoint banks), 300 AdamW steps per path with weight decay 0, 10% linear warmup then cosine decay,
seed 0. The rest (learning rates, how many query positions each step samples, the content initialization,
SmoothQuant's alpha grid) are ours; the paper does not state them. One default departs from the paper on purpose:
the RoPE objective weights each query-key pair's logit error by its attention probability (``rope_weighting=
"attention"``), which beat the paper's uniform objective at its own budget on every KL measured
(benchmarks/results/full_budget_paper.md, docs/calibrate.md); ``rope_weighting="uniform"`` is the paper's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

METHODS = ("quantmla", "rtn", "smoothquant", "quarot")
CONTENT_INITS = ("best", "identity", "hadamard")
ROPE_INITS = ("best", "identity")
ROPE_WEIGHTINGS = ("uniform", "attention")
ROPE_ROTATIONS = ("hadamard", "none")  # post-RoPE rotations a calibration can store (--rope-rotation)
ROTATION_SEED = 0  # the seed of the default post-RoPE Hadamard rotation, every layer
MATMUL_PRECISIONS = ("fp32", "tf32")
CONFIG_VERSION = 1

# ``paper``: Table 7. ``cpu-fast``: a reduced budget for small models on a CPU (the main job): about two minutes
# for a 30-layer, 135M-parameter model on 2 cores; most of QuantMLA's gain over the closed-form starts arrives in
# the first tens of steps. Its sequences stay 4x the default local window: with the sink and local tokens read in
# full precision, a query at position t reads quantized keys only when t > sink + local, and sequences of 256
# tokens (2x local) left so few that the learned transforms did not carry over to 512-token evaluation.
PRESETS: dict[str, dict] = {
    "paper": {},
    "cpu-fast": dict(
        seq_len=512, batch_size=2, train_seqs=8, val_seqs=4, steps_content=24, steps_rope=24, query_tokens=64
    ),
    # ``smoke``: exercises every code path in seconds (tests, quick checks); not a calibration.
    "smoke": dict(
        seq_len=192,
        batch_size=1,
        train_seqs=2,
        val_seqs=1,
        steps_content=2,
        steps_rope=2,
        query_tokens=16,
        smoothquant_alphas=(0.5,),
    ),
}


@dataclass(frozen=True)
class CalibrationConfig:
    """Settings of :func:`quantmla.calibrate.calibrate_model`.

    method: ``quantmla`` (learned transforms), or a baseline: ``rtn`` (identity), ``smoothquant`` (per-channel
        smoothing, alpha searched on validation), ``quarot`` (Hadamard latent rotation, random per-pair RoPE
        rotation).
    seq_len, batch_size, train_seqs, val_seqs: the calibration banks (token sequences are cut to ``seq_len``).
    steps_content, steps_rope: optimizer steps per path and attention layer.
    lr_content, lr_rope: AdamW learning rates (rotation generator and log-scales / log-scales and angles).
    weight_decay: AdamW weight decay (the paper uses 0).
    warmup_frac: fraction of the steps with linear warmup, then cosine decay to 0.
    query_tokens: query positions sampled per sequence and step (all keys are always kept; 0 = every position).
        The objectives are averages over queries, so sampling keeps them unbiased at a fraction of the cost.
    sink, local: the cache policy's full-precision tokens (first ``sink``; each query's last ``local``), which the
        objectives read exactly, as the runtime does (match the CachePolicy you serve with; 0/0 = all quantized).
    content_init: where the content transform starts: ``best`` (whichever of the identity, QuaRot's Hadamard
        rotation and SmoothQuant's smoothing at each alpha has the lowest validation objective), ``hadamard`` or
        ``identity``.
    rope_init: where the RoPE transform starts: ``best`` (identity or SmoothQuant's per-pair smoothing at each
        alpha, lowest validation objective) or ``identity``.
    rope_weighting: ``attention`` (each causal query-key pair's logit error weighted by its full-precision
        attention probability; ours, the default) or ``uniform`` (every pair counts the same: the paper's objective).
        A recorded config from before this option (it has ``version`` but no ``rope_weighting``) reads as uniform.
    learn_content_scales: also learn the per-channel scales of the content transform (else rotation only).
    select_on_val: keep the learned transform only if it beats its start and the identity on validation.
    smoothquant_alphas: the migration strengths SmoothQuant-MLA tries on validation.
    matmul_precision: ``fp32`` (default: the objectives' GEMMs in full fp32, as every published table was made)
        or ``tf32`` (on CUDA, fp32 GEMMs on TF32 tensor cores: ~8x the fp32 GEMM rate on Hopper, 10-bit mantissa
        products, far finer than the 2-4-bit quantization error the objectives measure; the CPU computes in fp32
        either way). Only the calibration steps and validations use it; the banks' forward passes stay fp32.
    seed: seeds sampling, initial rotations and the train/validation query subsets.
    device: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
    progress: show progress (tqdm bars on a terminal, compact lines with the time left otherwise).
    """

    method: str = "quantmla"
    seq_len: int = 2048
    batch_size: int = 4
    train_seqs: int = 128
    val_seqs: int = 32
    steps_content: int = 300
    steps_rope: int = 300
    lr_content: float = 5e-3
    lr_rope: float = 2e-2
    weight_decay: float = 0.0
    warmup_frac: float = 0.1
    query_tokens: int = 256
    sink: int = 4
    local: int = 128
    content_init: str = "best"
    rope_init: str = "best"
    rope_weighting: str = "attention"
    learn_content_scales: bool = True
    select_on_val: bool = True
    smoothquant_alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    matmul_precision: str = "fp32"
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"CalibrationConfig.method={self.method!r}; choose one of {METHODS}")
        if self.content_init not in CONTENT_INITS:
            raise ValueError(f"CalibrationConfig.content_init={self.content_init!r}; choose one of {CONTENT_INITS}")
        if self.rope_weighting not in ROPE_WEIGHTINGS:
            raise ValueError(
                f"CalibrationConfig.rope_weighting={self.rope_weighting!r}; choose one of {ROPE_WEIGHTINGS}"
            )
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"CalibrationConfig.matmul_precision={self.matmul_precision!r}; choose one of {MATMUL_PRECISIONS}"
            )
        if self.rope_init not in ROPE_INITS:
            raise ValueError(f"CalibrationConfig.rope_init={self.rope_init!r}; choose one of {ROPE_INITS}")
        for name in ("seq_len", "batch_size", "train_seqs", "val_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CalibrationConfig.{name} must be a positive integer, got {v!r}")
        for name in ("steps_content", "steps_rope", "query_tokens", "seed", "sink", "local"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CalibrationConfig.{name} must be an integer >= 0, got {v!r}")
        for name in ("lr_content", "lr_rope"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CalibrationConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.weight_decay < 0:
            raise ValueError(f"CalibrationConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"CalibrationConfig.warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        alphas = tuple(float(a) for a in self.smoothquant_alphas)
        if not alphas or any(not 0 <= a <= 1 for a in alphas):
            raise ValueError(f"CalibrationConfig.smoothquant_alphas must be non-empty values in [0, 1], got {alphas}")
        object.__setattr__(self, "smoothquant_alphas", alphas)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"CalibrationConfig.device={self.device!r}; use auto, cpu, cuda or cuda:N")
        if self.version != CONFIG_VERSION:
            raise ValueError(f"CalibrationConfig version {self.version} is not supported (expected {CONFIG_VERSION})")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["smoothquant_alphas"] = list(self.smoothquant_alphas)
        return d

    @classmethod
    def preset(cls, name: str, **overrides) -> CalibrationConfig:
        """A named starting point (see ``PRESETS``) with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(f"unknown calibration preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> CalibrationConfig:
        """A config from ``to_dict``'s output or a hand-written subset (missing fields take the defaults; a recorded
        config from before ``rope_weighting`` existed keeps its objective, :func:`recorded_rope_weighting`)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(
                f"unknown CalibrationConfig field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"valid fields: {', '.join(known)}"
            )
        d = dict(d)
        if "version" in d:  # recorded by to_dict: an objective it does not name is the one it was calibrated with
            d["rope_weighting"] = recorded_rope_weighting(d)
        if "smoothquant_alphas" in d:
            d["smoothquant_alphas"] = tuple(d["smoothquant_alphas"])
        return cls(**d)


def recorded_rope_weighting(recorded: dict) -> str:
    """The RoPE objective of a recorded recipe (a config dict in a checkpoint, a transforms file or a progress file):
    its ``rope_weighting``, or ``"uniform"`` -- the paper's, and the only one before the option existed -- when it has
    none. The one place that rule lives."""
    return recorded.get("rope_weighting", "uniform")
