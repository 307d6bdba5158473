"""Tracing across bus hops, metrics, and the instrumented bus connection. A leaf package."""
