"""`modelfleet ctl`: the operator's CLI. It talks only to the control plane's admin API.

`client.py` finds the admin API and calls it, answering with the models of
`modelfleet.messages.admin`; `render.py` prints those answers as tables; `commands.py` is the
command line.
"""
