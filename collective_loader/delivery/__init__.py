"""Delivery: process groups, agreements, one step of the protocol, the transfer thread, the copy to the GPU.

Everything that issues a collective lives here. It imports only :mod:`collective_loader.plan` and
:mod:`collective_loader.errors`.
"""
