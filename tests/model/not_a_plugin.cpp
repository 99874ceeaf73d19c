// A shared library without kiln_register_model_packages: loading it must fail by name.
extern "C" int kiln_something_else() { return 42; }
