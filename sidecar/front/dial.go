package main

import (
	"context"
	"errors"
	"net"
	"syscall"
	"time"
)

// engineDialer connects to the engine patiently. On a loaded host a burst of new connections
// can find the engine's accept queue full while its server catches up: the kernel then drops
// the SYN and the client's retransmissions wait 1, 2, 4 s. A fixed short dial timeout turned
// that wait into a 503 for a request the engine would have served, so a dial here is bounded
// by the request itself (the client going away) and by a generous overall limit, and a dial
// attempt that times out is simply made again. A refused connection (nothing listens: the
// engine is down or restarting) is not retried: the client gets a 503 with Retry-After at once.
type engineDialer struct {
	attempt time.Duration // one connect attempt's limit
	total   time.Duration // all attempts together (the request's own context may end sooner)
	dialer  net.Dialer
}

func newEngineDialer(total time.Duration) *engineDialer {
	return &engineDialer{attempt: 10 * time.Second, total: total,
		dialer: net.Dialer{KeepAlive: 30 * time.Second}}
}

func (d *engineDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, d.total)
	defer cancel()
	for {
		attempt, stop := context.WithTimeout(ctx, d.attempt)
		conn, err := d.dialer.DialContext(attempt, network, addr)
		stop()
		if err == nil {
			return conn, nil
		}
		if ctx.Err() != nil || errors.Is(err, syscall.ECONNREFUSED) || !isTimeout(err) {
			return nil, err
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
