"""Run the ``freqtrade`` command line offline: ``python tests/forecasts/freqtrade_offline.py backtesting ...``.

freqtrade asks the exchange for its market list when it starts; offline it stops at
"Could not load markets". freqtrade's own test suite supplies that list instead of the
exchange (tests/conftest.py: ``patch_exchange`` with ``get_markets()``). This does the same
at the one place freqtrade fetches it, ``Exchange._api_reload_markets``: the list of one spot
market is handed to ccxt (``set_markets``) as if the exchange had sent it. Nothing else is
patched: the backtest is freqtrade's own, and its strategy is loaded the way a user's is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING
from unittest.mock import patch

if TYPE_CHECKING:
    from freqtrade.exchange import Exchange

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# One Binance spot market in ccxt's structure (tick-size precision, as Binance reports it).
MARKETS = {
    "BTC/USDT": {
        "id": "BTCUSDT",
        "symbol": "BTC/USDT",
        "base": "BTC",
        "quote": "USDT",
        "baseId": "BTC",
        "quoteId": "USDT",
        "settle": None,
        "type": "spot",
        "spot": True,
        "margin": False,
        "swap": False,
        "future": False,
        "option": False,
        "contract": False,
        "linear": None,
        "inverse": None,
        "active": True,
        "taker": 0.001,
        "maker": 0.001,
        "precision": {"amount": 0.00001, "price": 0.01},
        "limits": {
            "amount": {"min": 0.00001, "max": 9000.0},
            "price": {"min": 0.01, "max": 1000000.0},
            "cost": {"min": 5.0, "max": 9000000.0},
            "leverage": {"min": None, "max": None},
        },
        "info": {},
    }
}


def main(argv: list[str]) -> None:
    """Run freqtrade's own ``main`` with the market list supplied."""
    from tests.forecasts.conftest import load_strategy

    load_strategy("freqtrade_adapter")  # the checkout's adapter under its installed name
    from freqtrade.exchange import Exchange
    from freqtrade.main import main as freqtrade_main

    async def markets_from_list(self: Exchange, reload: bool = False) -> None:
        self._api_async.set_markets(MARKETS)

    with patch.object(Exchange, "_api_reload_markets", markets_from_list):
        freqtrade_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
