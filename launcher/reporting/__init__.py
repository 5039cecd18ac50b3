"""What people see of a run, read back from its directory: the event logs
(``runlog``), the summary (``summary``), the status view (``status``, and its live
terminal form in ``live``), the timeline (``timeline``, drawn by ``plots``) and the
ETTR model behind ``ft-launch standby-size`` (``ettr``).

Only ``plots`` needs matplotlib (the ``[plot]`` extra), imported when a figure
is drawn: the control plane imports this package and must start fast.
"""
