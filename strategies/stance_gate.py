"""Example strategy (plain Python): the thesis as a gate and a size modifier on the robot's own forecast.

The robot's latest forecast proposes a direction; the latest thesis, read point-in-time,
votes on it:

* the robot has no fresh forecast, or forecasts flat → **skip** (nothing to gate);
* the thesis disagrees with the robot, or is neutral → **skip** (no support);
* the thesis agrees → enter, size ``base_size × robot confidence × (1 + agreement × score) / 2``,
  so strong agreement gives up to the full size and weak agreement about half of it;
* there is no valid thesis (none yet, stale, or unscored) → the thesis *abstains*: enter
  at ``abstain_size`` of the size (half by default; 0 makes a thesis mandatory). Abstaining
  is never sized above an agreeing thesis.

Run it against a database: ``python -m robot_llm.strategies.stance_gate -c config/demo.yaml``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Literal

from robot_llm.errors import RobotLLMError, run_main
from robot_llm.forecasts import Forecasts, parse_moment, require_aware

__all__ = ["Decision", "GateParams", "decide", "decide_all", "main"]

Action = Literal["long", "short", "skip"]


@dataclass(frozen=True, slots=True)
class GateParams:
    """How the gate weighs the thesis.

    ``min_agreement``: agreement (robot direction × thesis stance, -1..1) at or below which
    the entry is skipped. ``abstain_size``: fraction of the size used when no valid thesis
    exists. ``max_signal_age``: a robot forecast older than this counts as none.
    """

    base_size: float = 1.0
    min_agreement: float = 0.0
    abstain_size: float = 0.5
    max_signal_age: timedelta = timedelta(days=2)
    template: str | None = None

    def __post_init__(self) -> None:
        if self.base_size <= 0:
            raise ValueError(f"base_size must be positive, got {self.base_size}")
        if not -1.0 <= self.min_agreement < 1.0:
            raise ValueError(f"min_agreement must be in [-1, 1), got {self.min_agreement}")
        if not 0.0 <= self.abstain_size <= 1.0:
            raise ValueError(f"abstain_size must be in [0, 1], got {self.abstain_size}")


@dataclass(frozen=True, slots=True)
class Decision:
    """What the strategy does for one instrument at one moment, and why."""

    ticker: str
    as_of: datetime
    action: Action
    size: float
    agreement: float | None
    reason: str
    signal_id: int | None
    thesis_id: int | None


def decide(forecasts: Forecasts, ticker: str, as_of: datetime, params: GateParams = GateParams()) -> Decision:
    """The decision for ``ticker`` at ``as_of``, from what had been stored by then."""
    moment = require_aware(as_of, "as_of")
    signal = forecasts.latest_signal(ticker, moment, max_age=params.max_signal_age)
    if signal is None:
        return Decision(ticker, moment, "skip", 0.0, None, "no robot forecast", None, None)
    if not signal.direction:
        return Decision(ticker, moment, "skip", 0.0, None, "robot forecast is flat", signal.id, None)
    direction = 1 if signal.direction > 0 else -1
    action: Action = "long" if direction > 0 else "short"
    confidence = 1.0 if signal.confidence is None else min(max(signal.confidence, 0.0), 1.0)
    thesis = forecasts.latest(ticker, moment, template=params.template)
    if thesis is None or thesis.stance is None:
        why = "no valid thesis" if thesis is None else "thesis has no stance"
        thesis_id = None if thesis is None else thesis.id
        if params.abstain_size == 0:
            return Decision(ticker, moment, "skip", 0.0, None, f"{why}; a thesis is required", signal.id, thesis_id)
        size = params.base_size * confidence * params.abstain_size
        return Decision(ticker, moment, action, size, None, f"{why}: thesis abstains", signal.id, thesis_id)
    agreement = direction * max(-1.0, min(1.0, thesis.stance))
    if agreement <= params.min_agreement:
        verdict = "disagrees" if agreement < 0 else "does not support"
        reason = f"thesis {verdict} (stance {thesis.stance:+.2f} vs robot {action})"
        return Decision(ticker, moment, "skip", 0.0, agreement, reason, signal.id, thesis.id)
    score = 1.0 if thesis.score is None else min(max(thesis.score, 0.0), 1.0)
    size = params.base_size * confidence * (1.0 + agreement * score) / 2.0
    reason = f"thesis agrees (stance {thesis.stance:+.2f}, score {score:.2f})"
    return Decision(ticker, moment, action, size, agreement, reason, signal.id, thesis.id)


def decide_all(
    forecasts: Forecasts, tickers: Iterable[str], as_of: datetime, params: GateParams = GateParams()
) -> list[Decision]:
    """:func:`decide` for each ticker, in the order given."""
    return [decide(forecasts, t, as_of, params) for t in tickers]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m robot_llm.strategies.stance_gate -c FILE [--as-of T] [--ticker X] [--json]``."""
    parser = argparse.ArgumentParser(prog="stance_gate", description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, help="the robot-llm YAML config")
    parser.add_argument("--as-of", default="now", help="moment to decide at: ISO 8601 with zone, a date, or '1d'")
    parser.add_argument("--ticker", action="append", help="instrument (repeatable; default: all configured)")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    try:
        with Forecasts.from_config(args.config) as forecasts:
            as_of = parse_moment(args.as_of, tz=forecasts.timezone)
            decisions = decide_all(forecasts, args.ticker or forecasts.tickers, as_of)
    except RobotLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.json:
        for d in decisions:
            print(json.dumps(asdict(d), default=str, ensure_ascii=False))
        return 0
    print(f"stance_gate decisions as of {as_of.isoformat()}")
    for d in decisions:
        print(f"{d.ticker:<10} {d.action:<5} size {d.size:.3f}  {d.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
