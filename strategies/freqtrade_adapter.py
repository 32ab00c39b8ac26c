"""Example adapter: merge theses into a freqtrade-style candle frame without look-ahead.

In freqtrade a candle's ``date`` is its *open* time, and a signal computed on a candle
acts at the next candle's open — that is, at this candle's *close*. So a thesis may be
attached to a candle only if it was available at or before the candle's close
(``available_at <= date + timeframe``). Aligning on the open would be one candle late;
aligning on the thesis's ``as_of`` (its data cut-off) or on its trading date would use it
before it existed — a backtest that looks great and cannot be traded.

:func:`merge_theses` does the alignment with ``pandas.merge_asof(direction="backward")`` on
close time, then blanks theses that are stale at that close (they abstain). Which thesis
a candle gets is the one :meth:`Forecasts.latest` would return at the candle's close.

:class:`ThesisStrategy` has the shape of a freqtrade ``IStrategy`` (``populate_indicators``,
``populate_entry_trend``, ``populate_exit_trend``, ``bot_start``) and needs no freqtrade:
in a freqtrade install, ``class MyStrategy(ThesisStrategy, IStrategy)`` with
``robot_llm_config = "user_data/robot-llm.yaml"`` drops it in. Needs pandas.

Run it against a database: ``python -m robot_llm.strategies.freqtrade_adapter -c config/demo.yaml``
(it has no price data, so it prints the candle grid and which thesis each candle sees).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from robot_llm.config import parse_duration
from robot_llm.errors import RobotLLMError, run_main
from robot_llm.forecasts import Forecasts, ForecastsError, parse_moment, to_dataframe

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["MERGED_COLUMNS", "ThesisStrategy", "main", "merge_theses", "parse_timeframe"]

# The thesis columns added to the candle frame (thesis field -> column name).
MERGED_COLUMNS: dict[str, str] = {
    "id": "thesis_id",
    "stance": "thesis_stance",
    "score": "thesis_score",
    "stance_label": "thesis_stance_label",
    "available_at": "thesis_available_at",
    "valid_until": "thesis_valid_until",
}


def parse_timeframe(timeframe: str | timedelta) -> timedelta:
    """A freqtrade timeframe ('1m', '5m', '1h', '4h', '1d', '1w') as a timedelta.

    Months ('1M') are refused: their length varies, so a fixed close offset would be wrong.
    """
    if isinstance(timeframe, timedelta):
        if timeframe <= timedelta(0):
            raise ForecastsError(f"timeframe must be positive, got {timeframe}")
        return timeframe
    try:
        value = parse_duration(timeframe)
    except ValueError:
        raise ForecastsError(
            f"unsupported timeframe {timeframe!r}: use minutes, hours, days or weeks (1m, 1h, 1d)"
        ) from None
    if value <= timedelta(0):
        raise ForecastsError(f"timeframe must be positive, got {timeframe!r}")
    return value


def merge_theses(
    candles: pd.DataFrame, theses: pd.DataFrame, timeframe: str | timedelta, *, include_stale: bool = False
) -> pd.DataFrame:
    """Return ``candles`` with the thesis columns of :data:`MERGED_COLUMNS` attached, without look-ahead.

    ``candles`` needs a tz-aware ``date`` column (candle open time); ``theses`` is a frame from
    :func:`robot_llm.forecasts.to_dataframe` for one ticker. Each candle gets the latest thesis
    with ``available_at <= date + timeframe``, or nothing (NaN/None) when there is none or it
    is stale at that close (unless ``include_stale``). Row order and index are preserved.
    """
    import pandas as pd

    step = parse_timeframe(timeframe)
    if "date" not in candles.columns:
        raise ForecastsError("the candle frame has no 'date' column (freqtrade's candle open time)")
    dates = pd.to_datetime(candles["date"])
    if dates.dt.tz is None:
        raise ForecastsError("the candle 'date' column is naive; freqtrade candles are UTC-aware")
    if theses["ticker"].nunique() > 1:
        raise ForecastsError(f"merge one instrument at a time, got theses for {sorted(theses['ticker'].unique())}")

    out = candles.copy()
    # merge_asof needs both keys of one dtype; nanoseconds in UTC is what freqtrade uses.
    left = pd.DataFrame(
        {"_row": range(len(out)), "_close": (dates + step).dt.tz_convert("UTC").astype("datetime64[ns, UTC]")}
    ).sort_values("_close", kind="stable")
    right = theses.loc[:, [*MERGED_COLUMNS, "as_of"]].copy()
    right["_available"] = pd.to_datetime(right["available_at"], utc=True).astype("datetime64[ns, UTC]")
    # Among theses available at the same instant the last row wins: sort as latest() orders them.
    right = right.sort_values(["_available", "as_of", "id"], kind="stable").drop(columns="as_of")
    merged = pd.merge_asof(
        left, right, left_on="_close", right_on="_available", direction="backward", allow_exact_matches=True
    )
    if not include_stale:
        stale = merged["valid_until"].notna() & (merged["valid_until"] <= merged["_close"])
        merged.loc[stale, list(MERGED_COLUMNS)] = None
    merged = merged.sort_values("_row").reset_index(drop=True)
    for field, column in MERGED_COLUMNS.items():
        out[column] = merged[field].to_numpy()
    out["thesis_id"] = out["thesis_id"].astype("Int64")
    return out


class ThesisStrategy:
    """A freqtrade-shaped strategy that enters long when a fresh thesis is bullish enough.

    Mix it in front of ``IStrategy`` in a freqtrade install, or use it alone (tests, scripts)
    by setting :attr:`forecasts`. Override :meth:`ticker_for` when pair names ('SBER/RUB')
    do not start with the robot-llm ticker.
    """

    # Class attributes, as freqtrade strategies declare their settings.
    timeframe: str = "1h"
    min_stance: float = 0.3
    min_score: float = 0.5
    robot_llm_config: str | None = None
    template: str | None = None

    forecasts: Forecasts | None = None

    def bot_start(self, **kwargs: Any) -> None:
        """freqtrade calls this once: open the forecasts database named by :attr:`robot_llm_config`."""
        if self.forecasts is None:
            if self.robot_llm_config is None:
                raise ForecastsError("set ThesisStrategy.robot_llm_config to the robot-llm YAML config path")
            self.forecasts = Forecasts.from_config(self.robot_llm_config)

    def ticker_for(self, pair: str) -> str:
        """The robot-llm ticker of a freqtrade pair: its base asset."""
        return pair.split("/")[0]

    def populate_indicators(self, dataframe: pd.DataFrame, metadata: dict[str, Any]) -> pd.DataFrame:
        """Attach the thesis columns; in a backtest the frame is the whole timerange at once."""
        import pandas as pd

        if self.forecasts is None:
            self.bot_start()
        assert self.forecasts is not None
        ticker = self.ticker_for(metadata["pair"])
        if dataframe.empty:
            return merge_theses(dataframe, to_dataframe([]), self.timeframe)
        step = parse_timeframe(self.timeframe)
        dates = pd.to_datetime(dataframe["date"])
        first_close = dates.min().to_pydatetime() + step
        last_close = dates.max().to_pydatetime() + step
        # The thesis in force at the first close (possibly available long before), then every
        # thesis that arrived during the frame: exactly what a replay would have seen.
        seed = self.forecasts.latest(ticker, first_close, template=self.template, include_stale=True)
        rows = self.forecasts.history(ticker, first_close, last_close, template=self.template)
        records = ([seed] if seed is not None else []) + [r for r in rows if seed is None or r.id != seed.id]
        return merge_theses(dataframe, to_dataframe(records), step)

    def populate_entry_trend(self, dataframe: pd.DataFrame, metadata: dict[str, Any]) -> pd.DataFrame:
        """``enter_long = 1`` where the thesis is bullish and confident; ``enter_tag`` names the thesis."""
        bullish = (dataframe["thesis_stance"] >= self.min_stance) & (dataframe["thesis_score"] >= self.min_score)
        bullish = bullish.fillna(False).astype(bool)
        dataframe["enter_long"] = bullish.astype(int)
        dataframe["enter_tag"] = None
        dataframe.loc[bullish, "enter_tag"] = "thesis:" + dataframe.loc[bullish, "thesis_id"].astype(str)
        return dataframe

    def populate_exit_trend(self, dataframe: pd.DataFrame, metadata: dict[str, Any]) -> pd.DataFrame:
        """``exit_long = 1`` where the thesis turned bearish."""
        bearish = (dataframe["thesis_stance"] <= -self.min_stance).fillna(False).astype(bool)
        dataframe["exit_long"] = bearish.astype(int)
        return dataframe


def candle_grid(end: datetime, timeframe: str | timedelta, count: int) -> pd.DataFrame:
    """``count`` closed candles (open times only, no prices) ending at the last close at or before ``end``."""
    import pandas as pd

    step = parse_timeframe(timeframe)
    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    last_close = epoch + ((end - epoch) // step) * step
    dates = [last_close - step * (count - i) for i in range(count)]
    return pd.DataFrame({"date": pd.to_datetime(dates, utc=True).astype("datetime64[ns, UTC]")})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m robot_llm.strategies.freqtrade_adapter -c FILE [--as-of T] [--ticker X] [--timeframe 1h]``."""
    parser = argparse.ArgumentParser(prog="freqtrade_adapter", description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, help="the robot-llm YAML config")
    parser.add_argument(
        "--as-of", default="now", help="last candle closes at or before this (ISO 8601 with zone, date, '1d')"
    )
    parser.add_argument("--ticker", action="append", help="instrument (repeatable; default: all configured)")
    parser.add_argument("--timeframe", default=ThesisStrategy.timeframe, help="candle timeframe (default: %(default)s)")
    parser.add_argument("--candles", type=int, default=24, help="how many candles to show (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with Forecasts.from_config(args.config) as forecasts:
            as_of = parse_moment(args.as_of, tz=forecasts.timezone)
            step = parse_timeframe(args.timeframe)
            strategy = ThesisStrategy()
            strategy.forecasts = forecasts
            strategy.timeframe = args.timeframe
            print(f"freqtrade_adapter: {args.candles} x {args.timeframe} candles closing by {as_of.isoformat()}")
            print("(no prices here: each candle shows the thesis it may use at its close, and the entry signal;")
            print(" 'next' is the candle still open at --as-of: a thesis stored since the last close acts there)")
            for ticker in args.ticker or forecasts.tickers:
                # The closed candles, plus the one still forming: right after a night, the theses
                # are newer than the last close, and the forming candle is the first to use them.
                frame = candle_grid(as_of + step, step, max(args.candles, 1) + 1)
                meta = {"pair": ticker}
                frame = strategy.populate_indicators(frame, meta)
                frame = strategy.populate_exit_trend(strategy.populate_entry_trend(frame, meta), meta)
                print(f"\n{ticker}")
                for row in frame.itertuples(index=False):
                    if _missing(row.thesis_id):
                        thesis = "no valid thesis"
                    else:
                        thesis = f"thesis {row.thesis_id} stance {row.thesis_stance:+.2f}"
                    signal = "ENTER LONG" if row.enter_long else "EXIT" if row.exit_long else ""
                    close = row.date + step
                    label = "next " if close > as_of else "close"
                    print(f"  {label} {close.isoformat()}  {thesis:<32} {signal}".rstrip())
    except RobotLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def _missing(value: Any) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


if __name__ == "__main__":
    sys.exit(run_main(main))
