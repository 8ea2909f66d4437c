module slipstream.dev/front

go 1.22
