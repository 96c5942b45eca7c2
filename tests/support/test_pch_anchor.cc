// The target that compiles tests/support/test_pch.h once per build folder;
// every gtest binary reuses its precompiled header (see test_pch.h). An
// executable, so that it is compiled exactly as the tests are (-fPIE).
int main() { return 0; }
