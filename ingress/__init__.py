if __name__ != "switchyard.ingress":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.ingress, not {__name__}")
