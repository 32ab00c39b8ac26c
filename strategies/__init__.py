"""Example strategies that read robot-llm theses point-in-time (installed as ``robot_llm.strategies``).

* :mod:`.stance_gate` — plain Python: the thesis gates and sizes the robot's own forecast.
* :mod:`.freqtrade_adapter` — merge theses into a freqtrade-style candle frame on candle close.
"""
