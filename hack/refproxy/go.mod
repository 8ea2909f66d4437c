module slipstream.dev/refproxy

go 1.22
