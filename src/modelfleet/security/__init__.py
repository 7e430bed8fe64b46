"""Who may talk to whom: the fleet's own certificate authority and TLS (`pki.py`), join tokens
and node credentials (`joining.py`), and client API keys as stored (`apikeys.py`).

May import: cryptography, the standard library, the messages and the pure core.
"""
