"""An lm-evaluation-harness model class: run standard tasks on a model with a quantized MLA cache.

``lm_eval`` is optional (``pip install lm_eval``); importing this module without it works, instantiating
the adapter raises with the install command. Every request runs through a fresh cache of the chosen format
(absorbed attention for MLA models, see :mod:`quantmla.eval.runtime`)::

    from lm_eval import simple_evaluate
    from quantmla.eval.lm_eval_adapter import QuantMLALM
    lm = QuantMLALM(model, tokenizer, cache_format="c4r4")
    simple_evaluate(model=lm, tasks=["hellaswag"])   # with the dataset available locally

Or by name through lm_eval's registry once this module is imported: ``model="quantmla"`` with
``model_args="pretrained=DIR,cache_format=c4r4"``.
"""

from __future__ import annotations

import torch

from quantmla.eval.runtime import CacheSpec, eos_token_ids, forward_logits, make_cache, prepare_model

try:  # optional dependency
    from lm_eval.api.model import LM as _LMBase

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - exercised where lm_eval is absent
    _LMBase = object
    HAVE_LM_EVAL = False


class QuantMLALM(_LMBase):
    """lm_eval ``LM`` over a transformers causal LM whose KV cache is stored in ``cache_format``."""

    def __init__(
        self,
        model=None,
        tokenizer=None,
        cache_format: str = "bf16",
        sink: int = 4,
        local: int = 128,
        max_length: int = 2048,
        pretrained: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        **_,
    ):
        if not HAVE_LM_EVAL:
            raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install lm_eval")
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("pass a model and tokenizer, or pretrained=DIR")
            from quantmla.models.names import resolve_model

            model, tokenizer, _ = resolve_model(pretrained, dtype)
        self.model = prepare_model(model.to(device))
        self.tok = tokenizer
        self.cache = CacheSpec(str(cache_format).lower(), int(sink), int(local))
        self.max_length = int(max_length)
        self._device = torch.device(device)
        self._eos = eos_token_ids(self.model, tokenizer)

    # -- helpers --------------------------------------------------------------------------------------
    def _enc(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _prefix_token(self) -> int:
        for t in (getattr(self.tok, "bos_token_id", None), *self._eos):
            if t is not None:
                return int(t)
        return 0

    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(ids[t] | ids[:t]) for t >= 1: [len(ids) - 1] (fp32), through a fresh cache."""
        x = torch.tensor([ids], device=self._device)
        logits = forward_logits(self.model, x, make_cache(self.model, self.cache))[0]  # [T, V]
        return logits[:-1].log_softmax(-1), x[0, 1:]

    # -- the LM interface ---------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            # keep trailing whitespace of the context with the continuation, as lm_eval's HF model does
            n_sp = len(context) - len(context.rstrip())
            if n_sp:
                context, continuation = context[:-n_sp], context[-n_sp:] + continuation
            ctx = self._enc(context) if context else [self._prefix_token()]
            cont = self._enc(continuation)
            if not cont:  # empty continuation: probability 1
                out.append((0.0, True))
                continue
            ids = (ctx + cont)[-(self.max_length + 1) :]
            lp, tgt = self._logprobs(ids)
            lp, tgt = lp[-len(cont) :], tgt[-len(cont) :]
            ll = float(lp.gather(-1, tgt[:, None]).sum())
            greedy = bool((lp.argmax(-1) == tgt).all())
            out.append((ll, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args[:1]
            ids = [self._prefix_token()] + self._enc(text)
            total, start = 0.0, 0
            while start < len(ids) - 1:  # disjoint windows of max_length scored tokens
                end = min(start + self.max_length, len(ids) - 1)
                window = ids[start : end + 1]
                lp, tgt = self._logprobs(window)
                total += float(lp.gather(-1, tgt[:, None]).sum())
                start = end
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from quantmla.eval.runtime import greedy_generate

        out = []
        for req in requests:
            context, kw = req.args
            until = kw.get("until", []) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))
            ids = self._enc(context)[-self.max_length :]

            def stop(gen, until=until):
                text = self.tok.decode(gen, skip_special_tokens=True)
                return any(u in text for u in until)

            gen = greedy_generate(
                self.model,
                torch.tensor([ids], device=self._device),
                make_cache(self.model, self.cache),
                max_new,
                self._eos,
                stop=stop,
            )
            text = self.tok.decode(gen, skip_special_tokens=True)
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


if HAVE_LM_EVAL:  # register under the name "quantmla" (lm_eval --model quantmla)
    try:
        from lm_eval.api.registry import register_model

        register_model("quantmla")(QuantMLALM)
    except Exception:  # noqa: BLE001 - already registered, or a registry API change: the class still works
        pass
