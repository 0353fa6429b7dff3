"""The SwiftKV conformance suite: every implementation held to the reference (see README.md)."""
