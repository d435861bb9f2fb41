"""``adaptive``: which strategy each decode step runs, from calibrated step costs (the cost model
and its calibration) and pooled acceptance, chosen by the analytic selector."""
