// refproxy is the reference hop for `slipstream bench sidecar --reference-proxy`:
// a compiled reverse proxy that forwards every request to one engine and flushes
// each piece of a streamed answer as it arrives. It orders nothing, admits
// everything and counts nothing, so what it adds is what any proxy hop costs on
// the host (two more sockets per token, one more process wanting a CPU), the
// floor under the sidecar's own figure. Standard library only.
package main

import (
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"time"
)

func main() {
	engine := flag.String("engine", "", "engine base URL (http://127.0.0.1:PORT)")
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	flag.Parse()
	target, err := url.Parse(*engine)
	if err != nil || target.Scheme != "http" || target.Host == "" {
		fmt.Fprintf(os.Stderr, "refproxy: --engine must be an http:// URL, got %q\n", *engine)
		os.Exit(2)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.FlushInterval = -1 // write each piece of a streamed answer at once
	proxy.Transport = &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 4096, // keep one warm connection per concurrent stream
		IdleConnTimeout:     2 * time.Second,
		DisableCompression:  true,
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("refproxy: %v", err)
	}
	// The bench reads the port from this line.
	fmt.Printf("listening on %s\n", ln.Addr())
	os.Stdout.Sync()
	log.Fatal(http.Serve(ln, proxy))
}
