"""Real, deterministic inputs for Aurora parity checks (no download, no random numbers).

Series: the Mauna Loa atmospheric CO2 record shipped inside statsmodels
(``statsmodels.datasets.co2``; C. D. Keeling et al., Scripps; weekly means in ppm, 1958-03-29 to
2001-12-29, 2 284 values). 59 weeks have no measurement; they are filled by linear
interpolation between the neighbouring weeks (``pandas.Series.interpolate(method="linear")``; the
first and last weeks are measured, so no extrapolation happens). Loads offline in ≈ 0.06 s after
a ≈ 0.8 s ``import statsmodels.datasets`` (measured on the project's 2-core machine).

Windows: ``batch`` windows of ``context + max(horizons)`` consecutive weeks whose starts are
spread evenly over the record (``numpy.linspace`` rounded down), so with the defaults
(batch 4, context 528, horizons 96 and 80) the starts are 0, 553, 1106, 1660 (1958, 1968,
1979, 1990). Contexts never contain their own labels; windows of a batch may overlap by a few
weeks. Labels exist for every horizon: 96 (two 48-step tokens) and 80 (not a multiple of
Aurora's 48-step token, so the output-truncation path is exercised in eval; upstream's *train*
path raises on such a horizon: ``FlowLoss.forward`` multiplies the per-token loss ``[N, 48]`` by
the padding mask ``[1, 96]``).

Scale: the series is in ppm (≈ 315–370, varying by a few ppm). For checks judged by a relative
tolerance, use :meth:`AuroraBatch.normalized` (each window standardised by its context's mean and
std): in ppm the offset dilutes a real fault ≈ 200-fold (measured, see that method).

Text: one English sentence per window naming the station, unit and the window's years and
mean level, tokenised with the BERT tokenizer shipped in aurora-model exactly as upstream's
``TSGenerationMixin._tokenize`` does (padding to max_length 125, truncation).

Images (the real-image vision path, ``vision_ids=`` / ``generate(vision_inputs=...)``): the two
photographs scikit-learn ships with its datasets (``sklearn.datasets.load_sample_image``:
``china.jpg`` and ``flower.jpg``, 427×640 RGB, CC BY 2.0, see that package's
``datasets/images/README.txt``), decoded by Pillow, cut into square windows; see
:func:`real_images`.

Submodule inputs (:func:`embedded_tokens`, :func:`vision_features`, :func:`text_features`,
:func:`capture_submodule_inputs`, :func:`decoder_layer_inputs`) come from running the model's own
layers on these windows, so attention/encoder/decoder checks see realistic activations.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

__all__ = [
    "CONTEXT",
    "HORIZONS",
    "BATCH",
    "TEXT_MAX_LENGTH",
    "AuroraBatch",
    "load_co2_series",
    "make_batch",
    "describe_window",
    "tokenize",
    "revin_normalize",
    "pseudo_image",
    "real_images",
    "IMAGE_FILES",
    "embedded_tokens",
    "vision_features",
    "text_features",
    "capture_submodule_inputs",
    "decoder_layer_inputs",
    "flow_head_inputs",
    "make_elnino_batch",
    "elnino_start",
]

CONTEXT = 528
HORIZONS = (96, 80)
BATCH = 4
TEXT_MAX_LENGTH = 125  # upstream TSGenerationMixin.generate(max_text_token_length=125), TextEncoder.max_length
TOKEN_LEN = 48  # Aurora's patch length (config.json token_len)
DATASET = "statsmodels.datasets.co2 (Mauna Loa weekly atmospheric CO2, ppm)"
#: The photographs of :func:`real_images` (``sklearn.datasets.load_sample_image`` names).
IMAGE_FILES = ("china.jpg", "flower.jpg")


@functools.lru_cache(maxsize=1)
def _co2() -> tuple[np.ndarray, tuple[str, ...], int]:
    import statsmodels.datasets.co2 as co2

    frame = co2.load_pandas().data
    series = frame["co2"].astype("float64")
    gaps = int(series.isna().sum())
    filled = series.interpolate(method="linear")
    if filled.isna().any():
        raise RuntimeError("statsmodels co2: missing values remain after interpolation (edge gap); "
                           "the bundled dataset changed")
    dates = tuple(ts.strftime("%Y-%m-%d") for ts in frame.index)
    values = filled.to_numpy(copy=True)
    values.setflags(write=False)
    return values, dates, gaps


def load_co2_series() -> tuple[np.ndarray, tuple[str, ...], int]:
    """The full Mauna Loa CO2 record, gaps filled (cached per process).

    Returns:
        ``(values, dates, n_gaps)``: read-only float64 array of 2 284 weekly values in ppm,
        ISO dates (Saturdays) of the same length, and the number of interpolated weeks (59).
    Raises:
        ImportError: statsmodels is not installed (``pip install 'pytest-npu-parity[aurora]'``).
    """
    return _co2()


ELNINO = "statsmodels.datasets.elnino (monthly sea surface temperature, El Nino region, 1950-2010, deg C)"


def make_elnino_batch(windows: int = 8, context: int = CONTEXT, horizons: Sequence[int] = (96,),
                      starts: Sequence[int] | None = None) -> AuroraBatch:
    """``windows`` windows of the monthly El Niño sea-surface-temperature record (statsmodels'
    ``elnino``: 61 years × 12 months = 732 values, °C), evenly spaced, each ``context`` months with
    the next months as its labels (one per horizon) and an English description of its own: a series
    the CO2 windows of ``make_batch`` never show a model (held out from training).

    Args:
        windows: number of windows (ignored when ``starts`` is given).
        context: context length in months.
        horizons: label lengths in months (at least one).
        starts: the first month (index into the record) of each window, instead of even spacing.

    Returns:
        An :class:`AuroraBatch` (``starts`` the index of each window's first month, dates
        ``YYYY-MM-01``), float32 series in °C.

    Raises:
        ValueError: a size is not positive, or a window does not fit the 732 months.
    """
    import statsmodels.datasets.elnino as elnino

    frame = elnino.load_pandas().data
    values = frame.drop(columns="YEAR").to_numpy(dtype="float64").reshape(-1)
    dates = [f"{int(year)}-{month:02d}-01" for year in frame["YEAR"] for month in range(1, 13)]
    horizons = tuple(sorted({int(h) for h in horizons}))
    window = context + (horizons[-1] if horizons else 0)
    last = len(values) - window
    if starts is None:
        starts = [int(s) for s in np.floor(np.linspace(0, max(last, 0), max(windows, 1))).astype(int)]
    starts = [int(s) for s in starts]
    if windows < 1 or context < 1 or not horizons or horizons[0] < 1 or last < 0 or not starts or \
            not all(0 <= s <= last for s in starts):
        raise ValueError(f"make_elnino_batch: windows starting at {starts} with context {context} and horizons "
                         f"{horizons} do not fit the {len(values)}-month record (starts 0..{last})")
    texts = [f"Monthly mean sea surface temperature in degrees Celsius of the eastern equatorial Pacific "
             f"(El Nino region), from {dates[s][:4]} to {dates[s + context - 1][:4]}. The level averages "
             f"{values[s:s + context].mean():.1f} degrees and follows a yearly seasonal cycle with El Nino "
             f"warm spells every few years." for s in starts]
    tokens = tokenize(texts)
    labels = {h: torch.from_numpy(np.stack([values[s + context:s + context + h] for s in starts])).to(torch.float32)
              for h in horizons}
    return AuroraBatch(
        context=torch.from_numpy(np.stack([values[s:s + context] for s in starts])).to(torch.float32),
        labels=labels, text_input_ids=tokens["input_ids"], text_attention_mask=tokens["attention_mask"],
        text_token_type_ids=tokens["token_type_ids"], texts=texts, starts=starts,
        start_dates=[dates[s] for s in starts], end_dates=[dates[s + context - 1] for s in starts],
        n_gaps_interpolated=0, source=ELNINO)


def elnino_start(month: str) -> int:
    """The index in the El Niño record of ``month`` (``"YYYY-MM"``, 1950-01 is 0).

    Raises:
        ValueError: not a ``YYYY-MM`` month of 1950..2010.
    """
    try:
        year, mon = (int(x) for x in month.strip().split("-"))
    except ValueError:
        raise ValueError(f"El Nino month {month!r}: give YYYY-MM, e.g. 1956-06") from None
    if not (1950 <= year <= 2010 and 1 <= mon <= 12):
        raise ValueError(f"El Nino month {month!r}: the record covers 1950-01 to 2010-12")
    return (year - 1950) * 12 + mon - 1


def revin_normalize(series: torch.Tensor) -> torch.Tensor:
    """Upstream's RevIN normalisation: ``(x − mean) / (std_biased + 1e-5)`` over the last axis.

    ``AuroraForPrediction.forward``/``generate`` apply it before the model sees the series (the
    1e-5 is upstream's). Input ``[B, L]``; output same shape and dtype.
    """
    means = series.mean(dim=-1, keepdim=True)
    stdev = series.std(dim=-1, keepdim=True, unbiased=False) + 1e-5
    return (series - means) / stdev


def describe_window(start_date: str, end_date: str, values: np.ndarray) -> str:
    """English description of one window (fed to BERT): station, unit, years, mean level."""
    return (f"Weekly mean atmospheric carbon dioxide concentration in parts per million measured "
            f"at Mauna Loa Observatory, Hawaii, from {start_date[:4]} to {end_date[:4]}. The level "
            f"averages {values.mean():.1f} ppm, rises year after year and follows a yearly seasonal "
            f"cycle.")


def tokenize(texts: Sequence[str], max_length: int = TEXT_MAX_LENGTH) -> dict[str, torch.Tensor]:
    """Tokenise ``texts`` with aurora-model's BERT tokenizer, through upstream's own ``_tokenize``.

    Returns:
        ``{"input_ids", "attention_mask", "token_type_ids"}``, int64 ``[len(texts), max_length]``.
    Raises:
        ValueError: empty ``texts``.
    """
    if not texts:
        raise ValueError("tokenize: texts is empty")
    from aurora.ts_generation_mixin import TSGenerationMixin

    holder = type("_TokenizerHolder", (), {"tokenizer": TSGenerationMixin.tokenizer})()
    encoded = TSGenerationMixin._tokenize(holder, list(texts), max_length=max_length)
    return {key: encoded[key].to(torch.int64) for key in ("input_ids", "attention_mask", "token_type_ids")}


def _tensor_digest(digest: Any, name: str, tensor: torch.Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous()
    digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy())


@dataclass
class AuroraBatch:
    """A batch of real CO2 windows with labels and text.

    Attributes:
        context: float32 ``[B, context]``, ppm (raw; the model applies RevIN itself), or
            standardised (see :meth:`normalized` and ``scale``).
        labels: ``{horizon: float32 [B, horizon]}``, the weeks right after each context.
        text_input_ids / text_attention_mask / text_token_type_ids: int64 ``[B, 125]``.
        texts: the descriptions that were tokenised.
        starts: index of each window's first week in the record.
        start_dates / end_dates: ISO date of each context's first and last week.
        n_gaps_interpolated: interpolated weeks in the whole record (59).
        scale: ``"ppm"`` or the standardisation applied by :meth:`normalized`.
    """

    context: torch.Tensor
    labels: dict[int, torch.Tensor]
    text_input_ids: torch.Tensor
    text_attention_mask: torch.Tensor
    text_token_type_ids: torch.Tensor
    texts: list[str]
    starts: list[int]
    start_dates: list[str]
    end_dates: list[str]
    n_gaps_interpolated: int
    source: str = field(default=DATASET)
    scale: str = "ppm"

    @property
    def batch_size(self) -> int:
        """B."""
        return int(self.context.shape[0])

    @property
    def horizons(self) -> tuple[int, ...]:
        """The label horizons, ascending."""
        return tuple(sorted(self.labels))

    def text_kwargs(self) -> dict[str, torch.Tensor]:
        """``text_input_ids``/``text_attention_mask``/``text_token_type_ids`` for a forward."""
        return {"text_input_ids": self.text_input_ids, "text_attention_mask": self.text_attention_mask,
                "text_token_type_ids": self.text_token_type_ids}

    def forward_kwargs(self, horizon: int, *, train: bool = False, text: bool = True) -> dict[str, Any]:
        """Keyword arguments for ``AuroraForPrediction.forward``.

        Eval (``train=False``): ``input_ids``, ``max_output_length=horizon``,
        ``inference_token_len=48``. Train: ``input_ids`` and ``labels`` of ``horizon``.

        Raises:
            KeyError: no labels for ``horizon`` (available: :attr:`horizons`).
            ValueError: ``train=True`` with a horizon that is not a multiple of 48 (upstream's
                train path raises on it; measured with aurora-model 0.2.0).
        """
        if horizon not in self.labels:
            raise KeyError(f"no labels for horizon {horizon}; this batch has {self.horizons}")
        if train and horizon % TOKEN_LEN:
            raise ValueError(f"horizon {horizon} is not a multiple of {TOKEN_LEN}: upstream's train path "
                             "cannot take it (FlowLoss multiplies the per-token loss [N, 48] by the "
                             "padding mask [1, padded horizon] and raises a size mismatch); use it "
                             "for eval checks only")
        kwargs: dict[str, Any] = {"input_ids": self.context}
        if train:
            kwargs["labels"] = self.labels[horizon]
        else:
            kwargs.update(max_output_length=horizon, inference_token_len=TOKEN_LEN)
        if text:
            kwargs.update(self.text_kwargs())
        return kwargs

    def normalized(self) -> "AuroraBatch":
        """A copy standardised per window: ``(x − mean) / std`` with the context's statistics.

        Mean and (biased) standard deviation of each context row, applied to the context and its
        labels: the same statistics as upstream's RevIN (without its 1e-5). Why: CO2 sits near
        300–370 ppm and varies by a few ppm, so forecasts in ppm carry a large offset and a
        relative tolerance (fp32 rtol 1.3e-6 × 330 ppm ≈ 4e-4 ppm) hides real faults. Measured on
        the full model (batch 4, context 528, horizon 96): scaling one decoder FFN weight by
        (1 + 1e-4) moves the ppm forecast by max-abs 1.8e-4 (rel-L2 1.7e-7, passes
        ``allclose(rtol=1.3e-6, atol=1e-5)``) but the standardised forecast by max-abs 3.7e-5
        (rel-L2 3.2e-5, fails it). The model still applies RevIN, now to an almost-unit series.
        """
        context = self.context.double()
        means = context.mean(dim=1, keepdim=True)
        stdev = context.std(dim=1, keepdim=True, unbiased=False)

        def standardize(t: torch.Tensor) -> torch.Tensor:
            return ((t.double() - means) / stdev).to(t.dtype)

        return AuroraBatch(
            context=standardize(self.context), labels={h: standardize(v) for h, v in self.labels.items()},
            text_input_ids=self.text_input_ids.clone(), text_attention_mask=self.text_attention_mask.clone(),
            text_token_type_ids=self.text_token_type_ids.clone(), texts=list(self.texts),
            starts=list(self.starts), start_dates=list(self.start_dates), end_dates=list(self.end_dates),
            n_gaps_interpolated=self.n_gaps_interpolated, source=self.source,
            scale="standardized per window (context mean and std)")

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "AuroraBatch":
        """A copy with tensors on ``device``; ``dtype`` applies to the float series and labels only."""
        def move(t: torch.Tensor, is_float: bool) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if is_float else None)

        return AuroraBatch(
            context=move(self.context, True), labels={h: move(v, True) for h, v in self.labels.items()},
            text_input_ids=move(self.text_input_ids, False),
            text_attention_mask=move(self.text_attention_mask, False),
            text_token_type_ids=move(self.text_token_type_ids, False),
            texts=list(self.texts), starts=list(self.starts), start_dates=list(self.start_dates),
            end_dates=list(self.end_dates), n_gaps_interpolated=self.n_gaps_interpolated, source=self.source,
            scale=self.scale)

    def describe(self) -> dict[str, Any]:
        """JSON-ready input specification for baseline provenance."""
        import statsmodels

        return {
            "dataset": self.source,
            "statsmodels": statsmodels.__version__,
            "record_length": len(load_co2_series()[0]),
            "gaps_interpolated": self.n_gaps_interpolated,
            "gap_fill": "linear interpolation",
            "scale": self.scale,
            "batch": self.batch_size,
            "context": int(self.context.shape[1]),
            "horizons": list(self.horizons),
            "window_starts": list(self.starts),
            "window_dates": [f"{a}..{b}" for a, b in zip(self.start_dates, self.end_dates)],
            "dtype": str(self.context.dtype).replace("torch.", ""),
            "text_max_length": int(self.text_input_ids.shape[1]),
            "tokenizer": "aurora-model bert_config (BertTokenizer, uncased)",
            "fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """SHA-256 (hex) of every tensor (name, dtype, shape, bytes) and the texts."""
        digest = hashlib.sha256()
        _tensor_digest(digest, "context", self.context)
        for horizon in self.horizons:
            _tensor_digest(digest, f"labels[{horizon}]", self.labels[horizon])
        for name in ("text_input_ids", "text_attention_mask", "text_token_type_ids"):
            _tensor_digest(digest, name, getattr(self, name))
        digest.update(json.dumps([self.texts, self.scale]).encode())
        return digest.hexdigest()


def make_batch(batch: int = BATCH, context: int = CONTEXT, horizons: Sequence[int] = HORIZONS) -> AuroraBatch:
    """Cut ``batch`` windows from the CO2 record (see module docstring for placement).

    Args:
        batch: number of windows B (≥ 1).
        context: context length in weeks (≥ 1).
        horizons: label lengths in weeks (each ≥ 1; at least one).
    Returns:
        An :class:`AuroraBatch` (float32 series, int64 tokens, on the CPU).
    Raises:
        ValueError: a size is not positive, or ``context + max(horizons)`` exceeds the 2 284 weeks.
    """
    horizons = tuple(sorted({int(h) for h in horizons}))
    if batch < 1 or context < 1 or not horizons or horizons[0] < 1:
        raise ValueError(f"make_batch: batch, context and horizons must be positive, got batch={batch}, "
                         f"context={context}, horizons={horizons}")
    values, dates, gaps = load_co2_series()
    window = context + horizons[-1]
    if window > len(values):
        raise ValueError(f"make_batch: context {context} + horizon {horizons[-1]} = {window} weeks exceeds "
                         f"the {len(values)}-week CO2 record")
    starts = [int(s) for s in np.floor(np.linspace(0, len(values) - window, batch)).astype(int)]
    contexts = np.stack([values[s:s + context] for s in starts])
    labels = {h: torch.from_numpy(np.stack([values[s + context:s + context + h] for s in starts])).to(torch.float32)
              for h in horizons}
    start_dates = [dates[s] for s in starts]
    end_dates = [dates[s + context - 1] for s in starts]
    texts = [describe_window(a, b, values[s:s + context]) for s, a, b in zip(starts, start_dates, end_dates)]
    tokens = tokenize(texts)
    return AuroraBatch(
        context=torch.from_numpy(contexts).to(torch.float32), labels=labels,
        text_input_ids=tokens["input_ids"], text_attention_mask=tokens["attention_mask"],
        text_token_type_ids=tokens["token_type_ids"], texts=texts, starts=starts,
        start_dates=start_dates, end_dates=end_dates, n_gaps_interpolated=gaps)


# --------------------------------------------------------------------------------------------
# Submodule inputs
# --------------------------------------------------------------------------------------------

def pseudo_image(series: torch.Tensor, token_len: int = TOKEN_LEN) -> torch.Tensor:
    """The ViT input upstream builds from a series (``UnifiedImageProcessor.process_pseudo_image``).

    Runs upstream's own processor: period search by FFT, fold to ``[B, 1, period, L/period]``,
    resize to 224×224, repeat to 3 channels. Pass the RevIN-normalised series
    (:func:`revin_normalize`) to get what the model's ``VisionEncoder`` sees.

    Args:
        series: float ``[B, L]``.
        token_len: fallback period (upstream uses ``config.token_len``, 48).
    Returns:
        float ``[B, 3, 224, 224]``, same dtype and device as ``series``.
    """
    from aurora.configuration_aurora import AuroraConfig
    from aurora.modality_connector import UnifiedImageProcessor

    processor = UnifiedImageProcessor(AuroraConfig(token_len=token_len))
    with torch.no_grad():
        return processor.process_pseudo_image(series)


@functools.lru_cache(maxsize=None)
def _photo(name: str) -> np.ndarray:
    from sklearn.datasets import load_sample_image

    image = load_sample_image(name)
    image.setflags(write=False)
    return image


def real_images(batch: int = BATCH, crop: int = 320) -> list[np.ndarray]:
    """``batch`` real RGB photographs for ``VisionEncoder(..., type="real")``, as users pass them.

    Image ``i`` is a ``crop``×``crop`` window of photograph ``IMAGE_FILES[i % 2]`` (427×640); the
    k-th window taken from one photograph starts at column ``linspace(0, 640 - crop, n)[k]``
    (rounded down; n = windows taken from it) and at row ``(427 - crop) // 2``, so the windows of a
    batch differ. A crop other than 224 makes the ViT image processor resize (bilinear, to 224×224).
    Upstream feeds these to ``ViTImageProcessor(images=..., return_tensors="pt")``, which accepts
    NumPy arrays and PIL images, so they stay host arrays (the parity runner moves tensors only).

    Args:
        batch: number of images (≥ 1).
        crop: side of each square window in pixels (1 to 427).
    Returns:
        A list of ``batch`` new C-contiguous ``uint8`` arrays ``[crop, crop, 3]`` (copies: the cached
        photographs stay unchanged).
    Raises:
        ValueError: ``batch`` < 1 or ``crop`` outside 1..427.
        ImportError: scikit-learn is not installed (``pip install 'pytest-npu-parity[aurora]'``).
    """
    if batch < 1:
        raise ValueError(f"real_images: batch must be >= 1, got {batch}")
    photos = [_photo(name) for name in IMAGE_FILES]
    height = min(p.shape[0] for p in photos)
    if not 1 <= crop <= height:
        raise ValueError(f"real_images: crop must be 1..{height} pixels (the photographs are {height} high), got {crop}")
    images = []
    for i in range(batch):
        photo = photos[i % len(photos)]
        uses = len(range(i % len(photos), batch, len(photos)))
        starts = np.floor(np.linspace(0, photo.shape[1] - crop, uses)).astype(int)
        left, top = int(starts[i // len(photos)]), (photo.shape[0] - crop) // 2
        images.append(np.array(photo[top:top + crop, left:left + crop], order="C"))  # a copy
    return images


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def embedded_tokens(model: torch.nn.Module, batch: AuroraBatch, inference_token_len: int = TOKEN_LEN) -> torch.Tensor:
    """Patch embeddings of the normalised windows: ``[B, ceil(context/48), hidden]``.

    Uses the eval path of ``model.model.embed_layer`` (resampled projection), whatever the
    model's mode; this is the encoder input and the query of the vision/text guiders.
    """
    x = revin_normalize(batch.context).to(_model_device(model))
    tokens, _ = model.model.embed_layer._predict(x, inference_token_len)
    return tokens


@torch.no_grad()
def vision_features(model: torch.nn.Module, batch: AuroraBatch) -> torch.Tensor:
    """``VisionEncoder`` output on the pseudo-images of the normalised windows: ``[B, num_distill, hidden]``."""
    x = revin_normalize(batch.context).to(_model_device(model))
    return model.model.VisionEncoder(x, type="pseudo")


@torch.no_grad()
def text_features(model: torch.nn.Module, batch: AuroraBatch) -> torch.Tensor:
    """``TextEncoder`` output on the batch's descriptions: ``[B, num_distill, hidden]``."""
    device = _model_device(model)
    return model.model.TextEncoder({"input_ids": batch.text_input_ids.to(device),
                                    "attention_mask": batch.text_attention_mask.to(device),
                                    "token_type_ids": batch.text_token_type_ids.to(device)})


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


@torch.no_grad()
def capture_submodule_inputs(model: torch.nn.Module, batch: AuroraBatch, names: Sequence[str], *,
                             horizon: int = HORIZONS[0], seed: int = 0) -> dict[str, tuple[tuple, dict]]:
    """Inputs that named submodules receive during one eval forward on the batch.

    Runs ``model(**batch.forward_kwargs(horizon))`` once in eval mode (the model's mode is
    restored) with the torch RNG forked and seeded (the flow head samples noise), recording the
    first call of each submodule through a forward pre-hook.

    Args:
        model: an ``AuroraForPrediction`` (any device; the batch is moved there).
        batch: the inputs.
        names: dotted submodule names, e.g. ``"model.dec_layers.0"``, ``"retriever"``.
        horizon: forecast length (must have labels in the batch).
        seed: torch seed of the forward.
    Returns:
        ``{name: (args, kwargs)}`` with detached tensor clones.
    Raises:
        KeyError: a name is not a submodule, or a submodule was not called.
    """
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"capture_submodule_inputs: no submodule named {missing}; see model.named_modules()")
    captured: dict[str, tuple[tuple, dict]] = {}
    handles = []

    def make_hook(name: str):
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            captured.setdefault(name, (_detached(args), _detached(kwargs)))
        return hook

    was_training = model.training
    device = _model_device(model)
    try:
        for name in names:
            handles.append(modules[name].register_forward_pre_hook(make_hook(name), with_kwargs=True))
        model.eval()
        fork = (torch.random.fork_rng(devices=[]) if device.type == "cpu" else
                torch.random.fork_rng(devices=[device.index or 0], device_type=device.type))
        with fork:
            torch.manual_seed(seed)
            model(**batch.to(device).forward_kwargs(horizon))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    not_called = [n for n in names if n not in captured]
    if not_called:
        raise KeyError(f"capture_submodule_inputs: {not_called} were not called in the forward")
    return captured


def decoder_layer_inputs(model: torch.nn.Module, batch: AuroraBatch, index: int = 0, *,
                         horizon: int = HORIZONS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, cross_states)`` fed to ``model.model.dec_layers[index]``.

    Shapes ``[B, ceil(horizon/48), hidden]`` and ``[B, ceil(context/48), hidden]``.
    """
    name = f"model.dec_layers.{index}"
    args, kwargs = capture_submodule_inputs(model, batch, [name], horizon=horizon)[name]
    hidden_states = args[0] if args else kwargs["hidden_states"]
    cross_states = args[1] if len(args) > 1 else kwargs["cross_states"]
    return hidden_states, cross_states


def flow_head_inputs(model: torch.nn.Module, batch: AuroraBatch, *,
                     horizon: int = HORIZONS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``FlowLoss.sample`` receives in an eval forward: ``(z, prototypes)``.

    ``z`` is the last decoder layer's output, ``[B * ceil(horizon/48), hidden]``; ``prototypes`` the
    retriever's, ``[B * ceil(horizon/48), 48]`` (rows: series-major, then tokens, as upstream's
    ``rearrange(x_dec, 'b n d -> (b n) d')``). Computed on the model's device, no grad.
    """
    last = f"model.dec_layers.{model.config.num_dec_layers - 1}"
    captured = capture_submodule_inputs(model, batch, [last, "retriever"], horizon=horizon)
    with torch.no_grad():
        args, kwargs = captured[last]
        x_dec = model.get_submodule(last)(*args, **kwargs)[0]
        args, kwargs = captured["retriever"]
        prototypes = model.retriever(*args, **kwargs)
    return x_dec.reshape(-1, x_dec.shape[-1]), prototypes.reshape(-1, prototypes.shape[-1])
