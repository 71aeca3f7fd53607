"""``deepy-gpu-check``: a first look at an NVIDIA node in one command of under ten minutes.

``plan.py`` lists the checks and their time caps, ``checks.py`` measures, ``cli.py`` runs each check in
a process of its own under its cap and writes the results as JSON and a table.
"""
