"""Sync policies and the communication they choose: the policy contract and the built-in
policies, local SGD / DiLoCo, per-layer rules, averaging, compression, the transports."""
