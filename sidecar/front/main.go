// slipstream-front is the sidecar's online data path (started by `slipstream
// sidecar`, docs/sidecar.md). It serves the pod's OpenAI HTTP port:
// for each generation request it asks the sidecar's Python process, over a
// Unix socket, whether and with which vLLM priority to send it, or sends it at
// once inside the allowance the sidecar's dispatcher gave it ahead of time
// (control.go); nothing is decided here. It forwards the request to the engine,
// relays the answer byte for byte and reports its tokens back. Every other
// route is passed to the Python process's own HTTP server on a second Unix
// socket. The sidecar starts this process and stops it; when either side of
// the control socket goes away, so does this process. Standard library only.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// The largest request body taken (the sidecar's own routes take as much).
const maxBody = 64 << 20

const (
	routeCompletions = 'c'
	routeChat        = 'h'
)

var streamBroke = []byte(`data: {"error": {"message": "the inference engine stopped while streaming this answer; ` +
	`it is incomplete", "type": "EngineStreamError", "param": null, "code": 502}}` + "\n\n")

// relayBuffers keeps the 32 KiB read buffers of finished relays for the next
// ones: a burst of streams would otherwise allocate one each, and the garbage
// collector would run for them while the engine computes the burst's prefill.
var relayBuffers = sync.Pool{New: func() any {
	b := make([]byte, 32<<10)
	return &b
}}

type front struct {
	engine  string
	client  *http.Client
	control *control
	ids     atomic.Uint32
}

// engineIdleTimeout is how long an idle engine connection is kept for reuse: below the
// engine's own keep-alive (vLLM's uvicorn closes a connection idle for 5 s), so that a request
// is never written to a connection the engine is closing at that moment. Such a request would
// fail with a reset, and a POST that was written is not retried. The sidecar's own client
// keeps 2 s for the same reason.
const engineIdleTimeout = 2 * time.Second

// engineTransport is the front's pool of connections to the engine: up to conns kept idle,
// each dropped after engineIdleTimeout, dialled patiently (engineDialer).
func engineTransport(conns int, dialWait time.Duration) *http.Transport {
	return &http.Transport{
		DialContext:         newEngineDialer(dialWait).DialContext,
		MaxIdleConns:        conns,
		MaxIdleConnsPerHost: conns,
		IdleConnTimeout:     engineIdleTimeout,
		DisableCompression:  true,
	}
}

func main() {
	engine := flag.String("engine", "", "engine base URL (http://HOST:PORT)")
	listen := flag.String("listen", "127.0.0.1:8000", "address of the OpenAI HTTP port")
	controlPath := flag.String("control", "", "the sidecar's control socket")
	internal := flag.String("internal", "", "the sidecar's own HTTP server (Unix socket)")
	conns := flag.Int("engine-connections", 1024, "connections kept open to the engine")
	dialWait := flag.Duration("engine-dial-timeout", 60*time.Second,
		"how long a request waits to connect to a slow engine (a refused connection is not waited for)")
	flag.Parse()
	target, err := url.Parse(*engine)
	if err != nil || target.Scheme != "http" || target.Host == "" {
		fmt.Fprintf(os.Stderr, "slipstream-front: --engine must be an http:// URL, got %q\n", *engine)
		os.Exit(2)
	}
	if *controlPath == "" || *internal == "" {
		fmt.Fprintln(os.Stderr, "slipstream-front: --control and --internal are required")
		os.Exit(2)
	}
	ctl, err := dialControl(*controlPath)
	if err != nil {
		log.Fatalf("slipstream-front: %v", err)
	}
	f := &front{
		engine:  strings.TrimRight(*engine, "/"),
		client:  &http.Client{Transport: engineTransport(*conns, *dialWait)},
		control: ctl,
	}
	sidecar := httputil.NewSingleHostReverseProxy(&url.URL{Scheme: "http", Host: "sidecar"})
	sidecar.FlushInterval = -1
	sidecar.ErrorHandler = sidecarError
	sidecar.Transport = &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", *internal)
		},
		DisableCompression: true,
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		f.generate(w, r, routeCompletions, "/v1/completions")
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		f.generate(w, r, routeChat, "/v1/chat/completions")
	})
	mux.Handle("/", sidecar)
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("slipstream-front: %v", err)
	}
	go func() {
		log.Fatalf("slipstream-front: control link: %v", ctl.run())
	}()
	// The sidecar reads the bound port from this line.
	fmt.Printf("listening on %s\n", ln.Addr())
	os.Stdout.Sync()
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 30 * time.Second}
	log.Fatal(srv.Serve(ln))
}

func seconds(d time.Duration) float64 { return d.Seconds() }

// clientGone ends a request whose client has gone (or half-closed its
// connection, which Go's server takes as gone): the connection is closed with
// no answer, rather than an empty 200 or a proxy error the client never asked for.
func clientGone() { panic(http.ErrAbortHandler) }

// sidecarError answers a request the sidecar's own server could not: nothing
// when the client has gone, else 502 in vLLM's error shape.
func sidecarError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil {
		clientGone()
	}
	log.Printf("slipstream-front: the sidecar's own server: %v", err)
	writeError(w, http.StatusBadGateway, "the sidecar did not answer", "BadGatewayError")
}

// generate carries one completion or chat request: arrival, the sidecar's
// decision, the engine's answer relayed, the end reported.
func (f *front) generate(w http.ResponseWriter, r *http.Request, route byte, path string) {
	start := time.Now()
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		clientGone() // it went away while sending
	}
	if len(body) > maxBody {
		writeError(w, http.StatusRequestEntityTooLarge, "request body is larger than 64 MiB", "Request Entity Too Large")
		return
	}
	id := f.ids.Add(1)
	if maxTokens, ok := sendable(body); ok {
		if prio, sent := f.control.trySend(id, route, body, maxTokens); sent {
			f.finish(w, r, path, withPriority(body, prio), id, start)
			return
		}
	}
	wait := f.control.arrive(id, route, body)
	var rep reply
	select {
	case rep = <-wait:
	case <-r.Context().Done():
		f.control.forget(id)
		f.control.end(id, outcomeCancelled, 0, seconds(time.Since(start)), -1, -1)
		clientGone()
	}
	var data []byte
	switch rep.kind {
	case kindRefuse:
		if len(rep.payload) < 2 {
			writeError(w, http.StatusInternalServerError, "malformed refusal from the sidecar", "InternalServerError")
			return
		}
		status := int(rep.payload[0]) | int(rep.payload[1])<<8
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		w.Write(rep.payload[2:])
		return // the sidecar settled it when it refused
	case kindBody:
		data = rep.payload
	default:
		prio, perr := strconv.Atoi(string(rep.payload))
		if perr != nil {
			prio = 0
		}
		data = withPriority(body, prio)
	}
	f.finish(w, r, path, data, id, start)
}

// finish sends a granted request on and reports its end.
func (f *front) finish(w http.ResponseWriter, r *http.Request, path string, data []byte, id uint32, start time.Time) {
	toEngine := seconds(time.Since(start))
	outcome, tokens, relay := f.forward(w, r, path, data, id, start)
	f.control.end(id, outcome, uint32(tokens), seconds(time.Since(start)), toEngine, relay)
	if outcome == outcomeCancelled {
		clientGone()
	}
}

// sendable reports whether a body may go to the engine on arrival inside the
// allowance, and its output tokens: a JSON object (first byte '{' or white
// space, as the splice needs) without a client priority, asking for a number
// of tokens. Anything else is decided by the sidecar.
func sendable(body []byte) (int, bool) {
	if len(body) == 0 || !strings.ContainsRune("{ \t\r\n", rune(body[0])) {
		return 0, false
	}
	var probe struct {
		Priority            json.RawMessage `json:"priority"`
		MaxTokens           *int            `json:"max_tokens"`
		MaxCompletionTokens *int            `json:"max_completion_tokens"`
	}
	if json.Unmarshal(body, &probe) != nil || probe.Priority != nil {
		return 0, false
	}
	// As the sidecar reads it: max_tokens, or max_completion_tokens when that is unset or 0.
	asked := probe.MaxTokens
	if asked == nil || *asked == 0 {
		asked = probe.MaxCompletionTokens
	}
	if asked == nil || *asked < 1 {
		return 0, false
	}
	return *asked, true
}

// withPriority puts "priority":N in front of the members of the body's object
// (the sidecar grants with 'G' only a body it checked it can splice).
func withPriority(body []byte, prio int) []byte {
	i := bytes.IndexByte(body, '{')
	out := make([]byte, 0, len(body)+24)
	out = append(out, `{"priority":`...)
	out = strconv.AppendInt(out, int64(prio), 10)
	out = append(out, ',')
	return append(out, body[i+1:]...)
}

// forward sends the granted request to the engine and relays its answer; it
// returns the outcome, the output tokens and the first relay write's time
// (negative: none).
func (f *front) forward(w http.ResponseWriter, r *http.Request, path string, data []byte, id uint32, start time.Time) (byte, int, float64) {
	ctx := r.Context()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.engine+path, bytes.NewReader(data))
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error(), "InternalServerError")
		return outcomeEngineError, 0, -1
	}
	req.Header.Set("Content-Type", "application/json")
	// An empty idempotency key: the transport may send the request again on a new
	// connection when a reused one closed before any answer byte; the engine never
	// saw it, and generation has no side effects. The header is not sent.
	req.Header["X-Idempotency-Key"] = nil
	resp, err := f.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return outcomeCancelled, 0, -1
		}
		log.Printf("slipstream-front: engine unreachable: %v", err)
		writeError(w, http.StatusServiceUnavailable, "the inference engine is not reachable ("+cause(err)+")", "ServiceUnavailableError")
		return outcomeEngineError, 0, -1
	}
	defer resp.Body.Close()
	ctype := resp.Header.Get("Content-Type")
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(ctype, "text/event-stream") {
		answer, rerr := io.ReadAll(resp.Body)
		if rerr != nil {
			if ctx.Err() != nil {
				return outcomeCancelled, 0, -1
			}
			log.Printf("slipstream-front: engine answer broke: %v", rerr)
			writeError(w, http.StatusServiceUnavailable, "the inference engine is not reachable (it closed the connection)", "ServiceUnavailableError")
			return outcomeEngineError, 0, -1
		}
		if ctype == "" {
			ctype = "application/json"
		}
		w.Header().Set("Content-Type", ctype)
		w.WriteHeader(resp.StatusCode)
		w.Write(answer)
		if resp.StatusCode >= 400 && resp.StatusCode < 500 {
			return outcomeClientError, 0, -1
		}
		if resp.StatusCode != http.StatusOK {
			return outcomeEngineError, 0, -1
		}
		return outcomeOK, usageTokens(answer), -1
	}
	return f.relay(w, ctx, resp, ctype, id, start)
}

// relay copies a streamed answer to the client, each piece as it comes, and
// reports its tokens: the first at once (its TTFT), then whenever the output
// crosses a KV block (the dispatcher's estimate changes only there), and the
// rest at the end, with every token gap for the TBT histogram.
func (f *front) relay(w http.ResponseWriter, ctx context.Context, resp *http.Response, ctype string, id uint32, start time.Time) (byte, int, float64) {
	w.Header().Set("Content-Type", ctype)
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	sc := newScanner()
	bufp := relayBuffers.Get().(*[]byte)
	defer relayBuffers.Put(bufp)
	buf := *bufp
	bs := f.control.blockSize()
	relayFirst := -1.0
	var last time.Time
	reported := 0
	ttft := -1.0
	var gaps []float64
	report := func() {
		seen := sc.tokens()
		if seen != reported || ttft >= 0 || len(gaps) > 0 {
			f.control.progress(id, uint32(seen), ttft, gaps)
			reported, ttft, gaps = seen, -1, gaps[:0]
		}
	}
	defer report()
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			t := time.Now()
			found, texts := sc.feed(buf[:n])
			if found > 0 && sc.counted == found {
				ttft = seconds(t.Sub(start))
			}
			// Gaps between events that carry text, as the client sees them.
			for k := 0; k < texts; k++ {
				if sc.contents-texts+k > 0 {
					gaps = append(gaps, seconds(t.Sub(last)))
				}
				last = t
			}
			_, werr := w.Write(buf[:n])
			if werr == nil {
				werr = rc.Flush()
			}
			if relayFirst < 0 {
				relayFirst = seconds(time.Since(t))
			}
			if werr != nil {
				return outcomeCancelled, sc.tokens(), relayFirst
			}
			if ttft >= 0 || sc.tokens()/bs != reported/bs {
				report()
			}
		}
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) {
			return outcomeOK, sc.tokens(), relayFirst
		}
		if ctx.Err() != nil {
			return outcomeCancelled, sc.tokens(), relayFirst
		}
		// Tell the client in-band, in vLLM's error shape: without [DONE] or an error a
		// cut answer looks like a short one.
		log.Printf("slipstream-front: engine stream of request %d broke after %d events: %v", id, sc.counted, err)
		w.Write(streamBroke)
		rc.Flush()
		return outcomeEngineError, sc.tokens(), relayFirst
	}
}

// cause is a client-safe reason a connection to the engine failed (the details go to the log).
func cause(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset"
	case errors.As(err, &ne) && ne.Timeout():
		return "timed out"
	}
	return "connection failed"
}

// retryAfter is what a 503 tells clients: the engine is restarting or gone, try again.
const retryAfter = "1"

func writeError(w http.ResponseWriter, status int, message, kind string) {
	w.Header().Set("Content-Type", "application/json")
	if status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", retryAfter)
	}
	w.WriteHeader(status)
	msg, _ := json.Marshal(message)
	fmt.Fprintf(w, `{"error":{"message":%s,"type":%q,"param":null,"code":%d}}`, msg, kind, status)
}
