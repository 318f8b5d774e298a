"""Test doubles that ship with Corral, kept apart from the parts the server runs.

The real server never imports this package: it is for benchmarks that measure the control plane alone
(``corral bench control-plane``) and for tests, including users' own tests of code built on Corral.
"""
