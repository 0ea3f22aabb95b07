# SPDX-License-Identifier: Apache-2.0
"""bench-offload: the offload paths side by side on one GPU (scripts/bench-offload; its
command line and the steps of a run are in cli.py).

The modules follow a run: workloads and suite (what every engine runs, and which
configurations in which units), configs (a configuration's environment and engine
arguments), engines (running each unit's engines, or finding their results again through
saved_runs), placement (host reads per token from where the experts really were), rows and
results (the result JSON), report (its Markdown and plots). agreement, memory, profiles and
reproduction each hold one check against the unpatched engines: its figures and its lines
of the report.
"""
