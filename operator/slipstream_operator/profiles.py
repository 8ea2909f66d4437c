"""Finding the latency model of a (model, GPU) pair among the shipped profiles.

Profiles are ``latency_<slug>_<gpu>.json`` files written by ``slipstream
profile`` (``LinearLatencyModel.to_json``). The slug of a model name is its
last path component, lower-cased, with anything but ``[a-z0-9.-]`` replaced by
``-`` (``meta-llama/Llama-2-7b-hf`` -> ``llama-2-7b-hf``); the full name with
``/`` as ``--``, and the short form without ``meta-`` and ``-hf``/``-chat``/``-instruct``
(``llama-2-7b``), are tried too. A user folder is searched before the shipped one.

Deliberately left out: refitting from live step timings (``calibration``
scales a found profile by one factor; the sidecar reports only predicted and
observed step times, not the batch composition a full refit needs) and
downloading profiles.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from slipstream_scheduler.latency import LatencyModelError, LinearLatencyModel

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Profile:
    model: LinearLatencyModel
    name: str  # e.g. shipped:latency_llama-2-7b-hf_h100.json


def slugs(model: str) -> list[str]:
    """File-name forms of a model name, most specific first."""
    last = re.sub(r"[^a-z0-9.-]", "-", model.rsplit("/", 1)[-1].lower())
    short = re.sub(r"-(hf|instruct|chat)$", "", re.sub(r"^meta-", "", last))
    out = [last, model.lower().replace("/", "--"), short]
    return list(dict.fromkeys(out))


def find_profile(model: str, gpu: str, extra_dir: Path | None = None) -> Profile | None:
    """The first readable profile for (model, gpu), or None."""
    folders = [("user", extra_dir)] if extra_dir is not None else []
    import slipstream_scheduler

    shipped = Path(slipstream_scheduler.__file__).resolve().parent / "engine" / "profiles"
    folders.append(("shipped", shipped))
    for origin, folder in folders:
        if folder is None or not folder.is_dir():
            continue
        for slug in slugs(model):
            path = folder / f"latency_{slug}_{gpu.lower()}.json"
            if not path.is_file():
                continue
            try:
                return Profile(LinearLatencyModel.from_json(path.read_text()),
                               f"{origin}:{path.name}")
            except (OSError, LatencyModelError) as exc:
                logger.warning("skipping unreadable latency profile %s: %s", path, exc)
    return None
