package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fullListener is a loopback listener whose accept queue is full: nothing accepts, and the
// kernel drops further SYNs, as for an engine whose server is behind on a burst.
func fullListener(t *testing.T) net.Listener {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "listener")
	ln, err := net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	var held []net.Conn
	for i := 0; i < 8; i++ {
		c, err := net.DialTimeout("tcp", ln.Addr().String(), 300*time.Millisecond)
		if err != nil {
			break
		}
		held = append(held, c)
	}
	t.Cleanup(func() {
		for _, c := range held {
			c.Close()
		}
		ln.Close()
	})
	if _, err := net.DialTimeout("tcp", ln.Addr().String(), 500*time.Millisecond); !isTimeout(err) {
		t.Fatalf("the accept queue is not full (dial: %v)", err)
	}
	return ln
}

// A dial that would time out while the engine catches up is made again; it connects once the
// engine accepts, where one fixed-length attempt fails.
func TestASlowEngineIsWaitedForNotAnswered503(t *testing.T) {
	ln := fullListener(t)
	addr := ln.Addr().String()
	once := &engineDialer{attempt: time.Second, total: time.Second}
	if _, err := once.DialContext(context.Background(), "tcp", addr); !isTimeout(err) {
		t.Fatalf("one attempt against a full queue: %v, want a timeout", err)
	}
	go func() { // the engine catches up after two seconds
		time.Sleep(2 * time.Second)
		http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"usage":{"completion_tokens":3}}`))
		}))
	}()
	patient := &engineDialer{attempt: time.Second, total: 30 * time.Second}
	start := time.Now()
	f := &front{engine: "http://" + addr, client: &http.Client{Transport: &http.Transport{
		DialContext: patient.DialContext}}}
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader("{}"))
	outcome, tokens, _ := f.forward(rec, req, "/v1/completions", []byte("{}"), 1, time.Now())
	if outcome != outcomeOK || rec.Code != 200 || tokens != 3 {
		t.Fatalf("outcome %q status %d tokens %d body %s", outcome, rec.Code, tokens, rec.Body.Bytes())
	}
	if waited := time.Since(start); waited < 2*time.Second {
		t.Fatalf("connected after %v, before the engine accepted", waited)
	}
}

// Nothing listens (the engine is down or restarting): no waiting, a 503 with Retry-After.
func TestARefusedConnectionIsAnswered503WithRetryAfterAtOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	d := newEngineDialer(time.Minute)
	start := time.Now()
	f := &front{engine: "http://" + addr, client: &http.Client{Transport: &http.Transport{
		DialContext: d.DialContext}}}
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader("{}"))
	outcome, _, _ := f.forward(rec, req, "/v1/completions", []byte("{}"), 1, time.Now())
	if outcome != outcomeEngineError || rec.Code != 503 || rec.Header().Get("Retry-After") != retryAfter {
		t.Fatalf("outcome %q status %d headers %v", outcome, rec.Code, rec.Header())
	}
	if waited := time.Since(start); waited > 2*time.Second {
		t.Fatalf("a refused connection was waited on for %v", waited)
	}
}

// The client going away ends the wait for a slow engine.
func TestTheClientGoingAwayEndsTheWait(t *testing.T) {
	ln := fullListener(t)
	d := &engineDialer{attempt: time.Second, total: time.Minute}
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	if err == nil || !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("dial: %v", err)
	}
	if waited := time.Since(start); waited > 3*time.Second {
		t.Fatalf("waited %v after the client left", waited)
	}
}

// An engine connection idle for longer than engineIdleTimeout is not reused: the next request
// opens a new one, so the front never writes to a connection vLLM (5 s keep-alive) is closing.
// Within that time the connection is reused.
func TestAnIdleEngineConnectionIsDroppedBeforeTheEnginesKeepAlive(t *testing.T) {
	if engineIdleTimeout >= 5*time.Second {
		t.Fatalf("engineIdleTimeout %v is not below vLLM's 5 s keep-alive", engineIdleTimeout)
	}
	var mu sync.Mutex
	opened := 0
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("{}"))
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			mu.Lock()
			opened++
			mu.Unlock()
		}
	}
	srv.Start()
	defer srv.Close()
	client := &http.Client{Transport: engineTransport(8, time.Minute)}
	get := func() {
		resp, err := client.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return opened
	}
	get()
	get() // at once: the same connection
	if n := count(); n != 1 {
		t.Fatalf("two requests in a row opened %d connections, want 1", n)
	}
	time.Sleep(engineIdleTimeout + time.Second)
	get()
	if n := count(); n != 2 {
		t.Fatalf("a request after %v idle opened %d connections in all, want 2",
			engineIdleTimeout+time.Second, n)
	}
}
