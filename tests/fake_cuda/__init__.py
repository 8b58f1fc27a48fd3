"""Test harness for the runtime library: a fake libcuda and programs that use it."""
