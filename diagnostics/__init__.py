"""What the folder holds: `ptops diagnose` (`diagnose.py` assembles the report): replay monitors,
merge events, name runbooks; incidents (`incidents.py`), hang stacks grouped (`stacks.py`),
flight-recorder dumps through torch's analyser (`flightrec.py`), crashes in words (`crash.py`),
convergence against baselines (`baseline.py`); the self-contained HTML report (`html.py`: pure,
report dict + metrics records → HTML string, inline SVG, every run string escaped);
`profile.py`: the step-time breakdown of `ptops profile` traces (pure). May import (of ptops):
monitors, ckpt, runrecord (`html.py`: nothing).
"""
